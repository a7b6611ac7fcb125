"""The control channel's frames: binary batch and release records, bulk receive, descriptors."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from ipc import Arena, ChannelClosed, ControlChannel, ProtocolError, place_outputs, wire


def _pair() -> tuple[ControlChannel, ControlChannel]:
    left, right = socket.socketpair()
    return ControlChannel(left), ControlChannel(right)


def _batch(
    step: int, outputs: tuple[wire.OutputPlacement, ...], **extra: object
) -> wire.BatchReady:
    return wire.BatchReady(
        epoch=3,
        step=step,
        arena_id=2,
        slot=step % 4,
        generation=step + 1,
        outputs=outputs,
        nbytes=4096,
        padded=1,
        blocked_ns=17,
        busy_ns=2**40,
        **extra,  # type: ignore[arg-type]
    )


DENSE, _ = place_outputs(
    [
        ("image", "|u1", 1, [(8, 8, 3)] * 4, "HWC"),
        ("label", "<i4", 4, [()] * 4, ""),
    ]
)
RAGGED, _ = place_outputs([("tokens", "<i8", 8, [(5,), (0,), (7,)], "")])
EMPTY, _ = place_outputs([("nothing", "<f4", 4, [], "")])


@pytest.mark.parametrize("outputs", [DENSE, RAGGED, EMPTY], ids=["dense", "ragged", "empty"])
def test_batch_records_cross_in_binary_and_equal_the_sent_record(
    outputs: tuple[wire.OutputPlacement, ...],
) -> None:
    codec = wire.BatchCodec()
    record = _batch(5, outputs)
    frame = codec.encode(record)
    length, kind = wire.FRAME.unpack_from(frame)
    assert kind == wire.FRAME_BATCH and length == len(frame) - wire.FRAME.size
    decoded = wire.BatchCodec().decode(kind, frame, wire.FRAME.size, len(frame))
    assert decoded == record


def test_a_repeated_layout_is_decoded_once() -> None:
    codec = wire.BatchCodec()
    first = codec.decode_layout(codec.encode_layout(DENSE) or b"")
    again = codec.decode_layout(codec.encode_layout(DENSE) or b"")
    assert first == DENSE and again is first


def test_records_without_a_binary_layout_are_pickled() -> None:
    codec = wire.BatchCodec()
    skipped = _batch(1, DENSE, replaced=(2,), skipped=(37,), skipped_names=("a.jpg",))
    mixed_rank = (wire.OutputPlacement("x", "|u1", 0, 3, ((1,), (1, 2)), False, ""),)
    for record in (skipped, _batch(2, mixed_rank), wire.EpochEnd(1, 2, 3, 4)):
        frame = codec.encode(record)
        assert wire.FRAME.unpack_from(frame)[1] == wire.FRAME_PICKLED
    release = wire.Release(((0, 7), (3, 2**33)))
    frame = codec.encode(release)
    assert wire.FRAME.unpack_from(frame)[1] == wire.FRAME_RELEASE
    assert codec.decode(wire.FRAME_RELEASE, frame, wire.FRAME.size, len(frame)) == release


def test_bad_binary_frames_raise_protocol_errors() -> None:
    codec = wire.BatchCodec()
    frame = codec.encode(_batch(1, DENSE))
    with pytest.raises(ProtocolError, match="unknown frame kind"):
        codec.decode(9, frame, wire.FRAME.size, len(frame))
    with pytest.raises(ProtocolError):
        codec.decode(wire.FRAME_BATCH, frame, wire.FRAME.size, len(frame) - 3)
    with pytest.raises(ProtocolError, match="release"):
        codec.decode(wire.FRAME_RELEASE, b"\0" * 24, 0, 24)
    with pytest.raises(ProtocolError, match="torn"):
        wire.BatchCodec().decode_layout((codec.encode_layout(DENSE) or b"") + b"\0")


def test_everything_waiting_is_received_at_once_in_order() -> None:
    sender, receiver = _pair()
    try:
        sent = [_batch(step, DENSE) for step in range(50)]
        for record in sent:
            sender.send(record)
        big = threading.Thread(target=sender.send, args=(wire.LogRelay(20, "x" * 200_000),))
        big.start()  # larger than the receive buffer (and the socket's): sent while received
        received = receiver.receive_ready()
        assert len(received) >= 50  # one receive took every small record waiting
        while len(received) < 51:
            received += receiver.receive_ready()
        assert received[:50] == sent
        assert received[50] == wire.LogRelay(20, "x" * 200_000)
        assert receiver.receive_ready() == []  # nothing more, and no wait
        big.join()
    finally:
        sender.close()
        receiver.close()


def test_a_descriptor_arrives_with_its_record_among_others() -> None:
    sender, receiver = _pair()
    arena = Arena.create(7, 4096, 1, label="channel-test")
    try:
        for step in range(5):
            sender.send(_batch(step, DENSE))
        sender.send(wire.ArenaReady(7, 4096, 1), fd=arena.fd)
        for step in range(5, 10):
            sender.send(_batch(step, DENSE))
        records = []
        while len(records) < 11:
            records += receiver.receive_ready()
        assert records[5] == wire.ArenaReady(7, 4096, 1)
        fd = receiver.recv_fd()
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:channel-test")
        os.close(fd)
        with pytest.raises(ProtocolError, match="without one"):
            receiver.recv_fd()
    finally:
        arena.close()
        sender.close()
        receiver.close()


def test_end_of_stream_after_the_records_and_a_torn_frame_count_as_closed() -> None:
    sender, receiver = _pair()
    sender.send(wire.EpochEnd(0, 4, 1, 0))
    frame = wire.BatchCodec().encode(_batch(0, DENSE))
    os.write(sender.fileno(), frame[:-5])  # the peer dies in the middle of a frame
    sender.close()
    assert receiver.recv() == wire.EpochEnd(0, 4, 1, 0)
    assert receiver.receive_ready() == []
    assert receiver.at_eof
    assert receiver.receive_ready() == []
    with pytest.raises(ChannelClosed):
        receiver.recv()
    receiver.close()
    receiver.close()  # idempotent


def test_unreceived_descriptors_are_closed_with_the_channel() -> None:
    sender, receiver = _pair()
    arena = Arena.create(1, 4096, 1, label="channel-leak")
    sender.send(wire.ArenaReady(1, 4096, 1), fd=arena.fd)
    arena.close()
    assert receiver.recv() == wire.ArenaReady(1, 4096, 1)
    fds = set(os.listdir("/proc/self/fd"))
    receiver.close()  # the received memfd was never taken: the channel closes it
    gone = fds - set(os.listdir("/proc/self/fd"))
    assert len(gone) == 2  # the socket and the memfd
    sender.close()
