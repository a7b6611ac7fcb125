"""One transport interface over every kind of slot memory. Runs in both processes.

A worker writes batches into *regions*: a region is a set of equal slots in one kind of memory
(an anonymous ``memfd`` arena, :class:`ipc.Arena`, or a CUDA IPC ring, ``ipc._cuda``). Each side
holds one object per worker that hides which kind it has:

* :class:`SlotWriter` (worker): takes a free slot, makes sure the current region's slots are big
  enough (growing into a new region, announced to the trainer, when a batch does not fit), gives
  the address to copy to, and publishes the fill. A region replaced by a larger one is *retired*:
  it is closed when the last of its fills comes back.
* :class:`SlotReader` (trainer): opens every announced region, finds a descriptor's region by
  its ``arena_id`` (an older region's batch stays readable after the worker grew), checks the
  descriptor against that region's bounds before any view is made, cuts the slot into per-output
  arrays, and takes fills back. A retired region is closed once the trainer holds none of its
  fills.

The regions themselves implement two small protocols, :class:`WriterRegion` and
:class:`ReaderRegion`; callers never branch on which memory they have.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ._arena import PAGE, Arena, round_up
from ._channel import ControlChannel
from ._layout import check_fits
from ._ring import SlotLedger, SlotRing
from .wire import ArenaReady, BatchReady, CudaRingReady, OutputPlacement, ProtocolError

#: A first region's slots are this much larger than the first batch, so small changes need no
#: growth; a growing region at least doubles.
SLOT_HEADROOM = 1.25


class WriterRegion(Protocol):
    """The worker's side of one region of slots."""

    arena_id: int
    slot_size: int
    num_slots: int

    def address(self, slot: int) -> int:
        """Where to copy ``slot``'s batch (after ordering the copy behind the trainer's use)."""

    def finish_write(self, slot: int) -> None:
        """The batch is in ``slot``; make it visible to the trainer."""

    def copy_stream(self) -> int | None:
        """The stream device copies into this region run on (None for host memory)."""

    def announce(self, channel: ControlChannel) -> None:
        """Tell the trainer about this region (a record, and what travels with it)."""

    def close(self) -> None: ...


class ReaderRegion(Protocol):
    """The trainer's side of one region of slots."""

    arena_id: int
    slot_size: int
    num_slots: int

    def arrays(self, slot: int, placements: Sequence[OutputPlacement]) -> tuple[list[Any], object]:
        """Zero-copy arrays of every output (one array, or a list of per-sample arrays, each),
        and the object whose collection means the slot's views are all gone."""

    def released(self, slot: int) -> None:
        """The trainer is done with ``slot``'s fill (called before the release is sent)."""

    def close(self) -> None: ...


#: ``(arena_id, slot_size, needed_bytes) -> region``: how a worker makes a new region.
RegionFactory = Callable[[int, int, int], WriterRegion]


class SlotWriter:
    """A worker's slots: which are free, which region is current, which are retired."""

    def __init__(self, num_slots: int, create: RegionFactory, channel: ControlChannel) -> None:
        self.ring = SlotRing(num_slots)
        self._create = create
        self._channel = channel
        self._next_id = 0
        self.current: WriterRegion | None = None
        self._retired: dict[int, WriterRegion] = {}
        self._published_in: dict[int, int] = {}  # slot -> arena id of its published fill

    @property
    def num_slots(self) -> int:
        return self.ring.num_slots

    def acquire(self) -> int | None:
        """The oldest free slot, or None when the trainer holds every slot."""
        return self.ring.acquire()

    def reserve(self, nbytes: int) -> WriterRegion:
        """The current region, replaced first by a larger one when ``nbytes`` does not fit."""
        current = self.current
        if current is not None and nbytes <= current.slot_size:
            return current
        slot_size = round_up(max(int(nbytes * SLOT_HEADROOM), 1), PAGE)
        if current is not None:
            slot_size = max(slot_size, 2 * current.slot_size)
        self._next_id += 1
        region = self._create(self._next_id, slot_size, round_up(max(nbytes, 1), PAGE))
        try:
            region.announce(self._channel)
        except BaseException:
            region.close()
            raise
        if current is not None:
            if current.arena_id in self._published_in.values():
                self._retired[current.arena_id] = current  # the trainer still holds fills of it
            else:
                current.close()
        self.current = region
        return region

    def publish(self, slot: int) -> tuple[int, int]:
        """Hand ``slot`` (written in the current region) to the trainer: (arena id, generation)."""
        assert self.current is not None
        self.current.finish_write(slot)
        generation = self.ring.publish(slot)
        self._published_in[slot] = self.current.arena_id
        return self.current.arena_id, generation

    def abandon(self, slot: int) -> None:
        self.ring.abandon(slot)

    def release(self, slot: int, generation: int) -> None:
        """The trainer gave a fill back; a retired region goes with its last fill."""
        self.ring.release(slot, generation)
        arena_id = self._published_in.pop(slot, None)
        if arena_id in self._retired and arena_id not in self._published_in.values():
            self._retired.pop(arena_id).close()

    def region(self, arena_id: int) -> WriterRegion | None:
        if self.current is not None and self.current.arena_id == arena_id:
            return self.current
        return self._retired.get(arena_id)

    def close(self) -> None:
        for region in [*self._retired.values(), self.current]:
            if region is not None:
                region.close()
        self._retired.clear()
        self.current = None


class SlotReader:
    """The trainer's view of one worker's slots: open regions and the fills it holds."""

    def __init__(self, num_slots: int, owner: int = 0) -> None:
        """``owner``: the index of the worker whose slots these are."""
        self.owner = owner
        self.ledger = SlotLedger(num_slots)
        self._regions: dict[int, ReaderRegion] = {}
        self._current: int | None = None
        self._fills: dict[int, int] = {}  # slot -> arena id of the fill the trainer holds

    @property
    def held(self) -> int:
        return self.ledger.held

    @property
    def all_held(self) -> bool:
        return self.ledger.all_held

    @property
    def num_slots(self) -> int:
        return self.ledger.num_slots

    @property
    def open_regions(self) -> int:
        return len(self._regions)

    def attach(self, region: ReaderRegion) -> None:
        """A region the worker announced becomes current; the old one retires (or closes now)."""
        if region.arena_id in self._regions:
            region.close()
            raise ProtocolError(f"arena {region.arena_id} was announced twice")
        old = self._current
        self._regions[region.arena_id] = region
        self._current = region.arena_id
        self.ledger.resize(region.num_slots)
        if old is not None and old not in self._fills.values():
            self._regions.pop(old).close()

    def receive(self, descriptor: BatchReady) -> None:
        """Check a descriptor against its region's bounds and hold its fill."""
        region = self._regions.get(descriptor.arena_id)
        if region is None:
            raise ProtocolError(
                f"a batch names arena {descriptor.arena_id}, which was never announced or is "
                "already released"
            )
        if not 0 <= descriptor.slot < region.num_slots:
            raise ProtocolError(
                f"a batch names slot {descriptor.slot} of arena {descriptor.arena_id}, which has "
                f"{region.num_slots} slots"
            )
        check_fits(descriptor.outputs, region.slot_size)
        if not self.ledger.receive(descriptor.slot, descriptor.generation):
            raise ProtocolError(
                f"a batch fills slot {descriptor.slot} while the trainer still holds that slot"
            )
        self._fills[descriptor.slot] = descriptor.arena_id

    def arrays(self, descriptor: BatchReady) -> tuple[list[Any], object]:
        """Zero-copy arrays of a received descriptor's outputs, and their lease owner."""
        return self._regions[descriptor.arena_id].arrays(descriptor.slot, descriptor.outputs)

    def release(self, slot: int, generation: int) -> bool:
        """Give a held fill back (False when it was not held: stale or duplicate)."""
        if not self.ledger.release(slot, generation):
            return False
        arena_id = self._fills.pop(slot)
        region = self._regions[arena_id]
        region.released(slot)
        if arena_id != self._current and arena_id not in self._fills.values():
            del self._regions[arena_id]
            region.close()
        return True

    def close(self) -> None:
        regions, self._regions = list(self._regions.values()), {}
        self._fills.clear()
        self._current = None
        for region in regions:
            region.close()


def open_region(
    message: ArenaReady | CudaRingReady,
    channel: ControlChannel,
    stream_of: Callable[[int], int] | None,
) -> ReaderRegion:
    """The trainer's side of a region a worker announced (receives the arena's descriptor)."""
    if isinstance(message, ArenaReady):
        fd = channel.recv_fd()
        return Arena.attach(fd, message.arena_id, message.slot_size, message.num_slots)
    from ._cuda import CudaImporter

    if stream_of is None:
        raise ProtocolError("a worker announced a CUDA ring to a loader without device='gpu'")
    importer = CudaImporter(
        message.arena_id,
        message.device_id,
        message.slot_size,
        message.memory_handles,
        message.ready_handles,
        stream_of=stream_of,
    )
    importer.send_free_events(channel)
    return importer
