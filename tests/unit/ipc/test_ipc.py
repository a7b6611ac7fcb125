"""ipc/ without worker processes: arenas, fd passing, slot bookkeeping, layout."""

from __future__ import annotations

import gc
import multiprocessing
import os
import weakref

import numpy as np
import pytest

from ipc import (
    Arena,
    ControlChannel,
    ProtocolError,
    SlotReader,
    SlotRing,
    SlotState,
    SlotWriter,
    StaleReleaseError,
    check_fits,
    place_outputs,
    wire,
)


def test_arena_is_anonymous_and_shared_through_its_fd() -> None:
    arena = Arena.create(1, 4096, 3, label="test-arena")
    assert os.readlink(f"/proc/self/fd/{arena.fd}").startswith("/memfd:test-arena")
    peer = Arena.attach(os.dup(arena.fd), 1, 4096, 3)
    arena.write(2, 10, b"hello")
    view = np.asarray(peer.slot_view(2))
    assert view.shape == (4096,)
    assert view[10:15].tobytes() == b"hello"
    del view
    arena.close()
    peer.close()
    arena.close()  # idempotent


def test_slot_view_keeps_mapping_alive_and_reports_collection() -> None:
    arena = Arena.create(1, 4096, 2, label="test-arena")
    arena.write(1, 0, np.arange(4, dtype=np.float32).tobytes())
    slot_view = arena.slot_view(1)
    released = []
    weakref.finalize(slot_view, released.append, 1)
    values = np.asarray(slot_view)[:16].view(np.float32).reshape(2, 2)
    del slot_view
    arena.close()  # the live view keeps the mapping; nothing is unmapped under it
    assert released == []
    assert values.tolist() == [[0.0, 1.0], [2.0, 3.0]]
    del values
    gc.collect()
    assert released == [1]


def test_arena_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="multiple"):
        Arena.create(1, 1000, 1, label="x")
    with pytest.raises(ValueError, match="num_slots"):
        Arena.create(1, 4096, 0, label="x")


def test_channel_sends_records_and_descriptors() -> None:
    left, right = multiprocessing.Pipe()
    a, b = ControlChannel(left), ControlChannel(right)
    arena = Arena.create(3, 4096, 1, label="fd-pass")
    a.send(wire.ArenaReady(3, 4096, 1), fd=arena.fd)
    message = b.recv()
    assert message == wire.ArenaReady(3, 4096, 1)
    fd = b.recv_fd()
    peer = Arena.attach(fd, 3, 4096, 1)
    arena.write(0, 0, b"xyz")
    assert bytes(np.asarray(peer.slot_view(0))[:3]) == b"xyz"
    peer.close()
    arena.close()
    a.close()
    from ipc import ChannelClosed

    with pytest.raises(ChannelClosed):
        b.recv()
    b.close()


def test_a_starting_record_travels_and_says_how_far_the_worker_is() -> None:
    left, right = multiprocessing.Pipe()
    a, b = ControlChannel(left), ControlChannel(right)
    record = wire.Starting("source", "indexing 10000 tar shards", 123, 10_000, 41.4)
    a.send(record)
    assert b.recv() == record
    assert record.describe() == "indexing 10000 tar shards: 123 of 10,000 done, 41 s"
    assert wire.Starting("startup", "importing DALI").describe() == "importing DALI"
    a.close()
    b.close()


def test_ring_transitions_and_stale_releases() -> None:
    ring = SlotRing(2)
    first = ring.acquire()
    second = ring.acquire()
    assert (first, second) == (0, 1)
    assert ring.acquire() is None
    assert ring.publish(0) == 1
    ring.abandon(1)
    assert ring.states == [SlotState.PUBLISHED, SlotState.FREE]
    with pytest.raises(StaleReleaseError):
        ring.release(0, 2)
    ring.release(0, 1)
    with pytest.raises(StaleReleaseError):
        ring.release(0, 1)  # twice
    with pytest.raises(RuntimeError):
        ring.publish(0)  # not WRITING
    assert ring.free_count == 2


def _fill(arena_id: int, slot: int, generation: int, values: np.ndarray) -> wire.BatchReady:
    placements, nbytes = place_outputs(
        [("x", values.dtype.str, values.itemsize, [values.shape], "")]
    )
    return wire.BatchReady(0, 0, arena_id, slot, generation, placements, nbytes, 0, 0, 0)


def _announce(reader: SlotReader, arena: Arena) -> None:
    peer = Arena.attach(os.dup(arena.fd), arena.arena_id, arena.slot_size, arena.num_slots)
    reader.attach(peer)


def test_slot_reader_checks_every_descriptor_before_a_view() -> None:
    arena = Arena.create(1, 4096, 2, label="test-arena")
    reader = SlotReader(2)
    try:
        _announce(reader, arena)
        good = _fill(1, 0, 1, np.arange(4, dtype=np.int32))
        with pytest.raises(ProtocolError, match="arena 9"):
            reader.receive(_fill(9, 0, 1, np.arange(4, dtype=np.int32)))
        with pytest.raises(ProtocolError, match="slot 5"):
            reader.receive(_fill(1, 5, 1, np.arange(4, dtype=np.int32)))
        with pytest.raises(ProtocolError, match="does not fit"):
            reader.receive(_fill(1, 0, 1, np.zeros(5000, dtype=np.uint8)))
        lying = wire.BatchReady(
            0,
            0,
            1,
            0,
            1,
            (wire.OutputPlacement("x", "<i4", 0, 8, ((4,),), True, ""),),
            8,
            0,
            0,
            0,
        )
        with pytest.raises(ProtocolError, match="claims 8 bytes"):
            reader.receive(lying)
        reader.receive(good)
        with pytest.raises(ProtocolError, match="still holds"):
            reader.receive(_fill(1, 0, 2, np.arange(4, dtype=np.int32)))
        assert reader.held == 1
        assert not reader.release(0, 7)  # a stale generation is ignored
        assert reader.release(0, 1)
        assert not reader.release(0, 1)  # twice
        assert reader.held == 0
    finally:
        reader.close()
        arena.close()


def test_a_retired_arena_stays_readable_until_its_last_fill_comes_back() -> None:
    old = Arena.create(1, 4096, 2, label="test-arena")
    new = Arena.create(2, 8192, 2, label="test-arena")
    reader = SlotReader(2)
    try:
        _announce(reader, old)
        old.write(1, 0, np.arange(4, dtype=np.int32).tobytes())
        reader.receive(_fill(1, 1, 1, np.arange(4, dtype=np.int32)))
        _announce(reader, new)  # the worker grew while the trainer holds slot 1 of arena 1
        assert reader.open_regions == 2
        arrays, lease = reader.arrays(_fill(1, 1, 1, np.arange(4, dtype=np.int32)))
        assert arrays[0].tolist() == [[0, 1, 2, 3]]
        assert reader.release(1, 1)
        assert reader.open_regions == 1  # retired with its last fill
        assert arrays[0].tolist() == [[0, 1, 2, 3]]  # the live view kept its mapping
        del arrays, lease
    finally:
        reader.close()
        old.close()
        new.close()


def test_slot_writer_grows_and_closes_a_retired_region_with_its_last_fill() -> None:
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    made: list[Arena] = []

    def create(arena_id: int, slot_size: int, needed: int) -> Arena:
        made.append(Arena.create(arena_id, slot_size, 2, label="test-writer"))
        return made[-1]

    writer = SlotWriter(2, create, ControlChannel(ours))
    peer = ControlChannel(theirs)
    try:
        slot = writer.acquire()
        assert slot is not None
        first = writer.reserve(100)
        assert first.slot_size == 4096
        assert writer.publish(slot) == (1, 1)
        announced = peer.recv()
        assert isinstance(announced, wire.ArenaReady) and announced.arena_id == 1
        os.close(peer.recv_fd())
        second_slot = writer.acquire()
        assert second_slot is not None
        grown = writer.reserve(10_000)  # does not fit: a new, larger region
        assert grown.arena_id == 2 and grown.slot_size >= 10_000
        assert isinstance(peer.recv(), wire.ArenaReady)
        os.close(peer.recv_fd())
        assert not made[0].closed  # the trainer still holds a fill of it
        writer.abandon(second_slot)
        writer.release(slot, 1)
        assert made[0].closed
    finally:
        writer.close()
        peer.close()
        assert all(arena.closed for arena in made)


def test_place_outputs_aligns_and_detects_ragged() -> None:
    placements, total = place_outputs(
        [
            ("image", "<f4", 4, [(3, 2, 2)] * 2, "CHW"),
            ("jpeg", "|u1", 1, [(5,), (7,)], ""),
        ]
    )
    image, jpeg = placements
    assert image.offset == 0 and image.nbytes == 96 and image.dense
    assert jpeg.offset == 128 and jpeg.nbytes == 12 and not jpeg.dense
    assert total == 192
    check_fits(placements, 4096)
    with pytest.raises(ProtocolError, match="does not fit"):
        check_fits(placements, 100)
