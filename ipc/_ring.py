"""Slot bookkeeping shared by every memory backend (memfd arena, CUDA ring).

Runs in both processes, and touches no memory: it only counts. The worker owns a
:class:`SlotRing` (which of its slots it may write); the trainer owns a :class:`SlotLedger` per
worker (which fills it holds, so a stale or duplicated descriptor is rejected and a trainer that
holds every slot is detected instead of deadlocking).
"""

from __future__ import annotations

import enum


class SlotState(enum.IntEnum):
    """The life of one slot, as the worker sees it.

    Legal transitions::

        FREE --acquire--> WRITING --publish--> PUBLISHED --release(generation)--> FREE
        WRITING --abandon--> FREE          (an error happened before the descriptor was sent)
    """

    FREE = 0
    WRITING = 1
    PUBLISHED = 2


class StaleReleaseError(RuntimeError):
    """A release named a generation the slot no longer has."""


class SlotRing:
    """The worker's view of its slots: a FIFO of free slots and one generation counter per slot."""

    __slots__ = ("_free", "generations", "states")

    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.states = [SlotState.FREE] * num_slots
        self.generations = [0] * num_slots
        self._free = list(range(num_slots))

    @property
    def num_slots(self) -> int:
        return len(self.states)

    @property
    def free_count(self) -> int:
        return len(self._free)

    def acquire(self) -> int | None:
        """Take the oldest free slot for writing, or None when every slot is published."""
        if not self._free:
            return None
        slot = self._free.pop(0)
        self.states[slot] = SlotState.WRITING
        return slot

    def publish(self, slot: int) -> int:
        """Mark a written slot as handed to the trainer; returns the fill's generation."""
        if self.states[slot] is not SlotState.WRITING:
            raise RuntimeError(f"slot {slot} is {self.states[slot].name}, not WRITING")
        self.generations[slot] += 1
        self.states[slot] = SlotState.PUBLISHED
        return self.generations[slot]

    def abandon(self, slot: int) -> None:
        """Give back a slot taken by acquire() that was never published."""
        if self.states[slot] is not SlotState.WRITING:
            raise RuntimeError(f"slot {slot} is {self.states[slot].name}, not WRITING")
        self.states[slot] = SlotState.FREE
        self._free.insert(0, slot)

    def release(self, slot: int, generation: int) -> None:
        """The trainer gave back fill ``generation`` of ``slot``."""
        if not 0 <= slot < len(self.states):
            raise StaleReleaseError(f"release of slot {slot}, which does not exist")
        if self.states[slot] is not SlotState.PUBLISHED or self.generations[slot] != generation:
            raise StaleReleaseError(
                f"release of slot {slot} generation {generation}, but the slot is "
                f"{self.states[slot].name} at generation {self.generations[slot]}"
            )
        self.states[slot] = SlotState.FREE
        self._free.append(slot)


class SlotLedger:
    """The trainer's view of one worker's slots: which fills it currently holds."""

    __slots__ = ("_held", "num_slots")

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._held: dict[int, int] = {}  # slot -> generation

    @property
    def held(self) -> int:
        """Fills received and not yet released (queued or in the user's hands)."""
        return len(self._held)

    @property
    def all_held(self) -> bool:
        return len(self._held) >= self.num_slots

    def receive(self, slot: int, generation: int) -> bool:
        """Hold a fill; False (nothing recorded) when the slot's previous fill is still held."""
        if slot in self._held:
            return False
        self._held[slot] = generation
        return True

    def release(self, slot: int, generation: int) -> bool:
        """Forget a fill. False when that fill is not held (already released: stale)."""
        if self._held.get(slot) != generation:
            return False
        del self._held[slot]
        return True

    def resize(self, num_slots: int) -> None:
        self.num_slots = num_slots
