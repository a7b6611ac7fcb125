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
    SlotLedger,
    SlotRing,
    SlotState,
    StaleReleaseError,
    check_fits,
    place_outputs,
)
from ipc import _wire as wire


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
    a.send(wire.ArenaReady(3, 4096, 1))
    a.send_fd(arena.fd)
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


def test_ledger_rejects_duplicates_and_counts_held() -> None:
    ledger = SlotLedger(2)
    ledger.receive(0, 1)
    with pytest.raises(RuntimeError, match="still held"):
        ledger.receive(0, 2)
    ledger.receive(1, 1)
    assert ledger.all_held
    assert not ledger.release(0, 5)
    assert ledger.release(0, 1)
    assert not ledger.release(0, 1)
    assert ledger.held == 1
    with pytest.raises(RuntimeError, match="slot 7"):
        ledger.receive(7, 1)


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
    with pytest.raises(RuntimeError, match="does not fit"):
        check_fits(placements, 100)
