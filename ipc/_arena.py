"""An arena: one anonymous shared-memory region cut into equal, reusable slots.

Runs in both processes. The worker *creates* its arena (``Arena.create``): an anonymous ``memfd``
with no name in ``/dev/shm``, so a crash cannot leave an entry behind; the memory goes away when
the last mapping and the last descriptor are gone. Pages are reserved at creation with
``posix_fallocate`` so that too little shared memory is a clear error now, never a ``SIGBUS`` in
the middle of an epoch. The file descriptor travels once to the trainer over the control socket;
the trainer *attaches* (``Arena.attach``), maps it and closes the descriptor it received.

Lifetimes: ``close()`` drops this process's mapping. On the trainer side a slot's numpy views keep
the mapping alive through :class:`SlotView`, so ``close()`` there only forgets the arena and the
mapping goes when the last view is collected; memory is never unmapped under a live view.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import math
import mmap
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .wire import ArenaReady, OutputPlacement

if TYPE_CHECKING:
    from ._channel import ControlChannel

PAGE = mmap.PAGESIZE
#: Every output inside a slot starts on this boundary.
OUTPUT_ALIGN = 64


class SharedMemoryError(MemoryError):
    """Shared memory for an arena could not be reserved."""


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class Arena:
    """``num_slots`` slots of ``slot_size`` bytes in one shared mapping."""

    __slots__ = ("_address", "_anchor", "_fd", "_mmap", "arena_id", "num_slots", "slot_size")

    def __init__(self, fd: int, arena_id: int, slot_size: int, num_slots: int) -> None:
        if slot_size <= 0 or slot_size % PAGE:
            raise ValueError(f"slot_size must be a positive multiple of {PAGE}, got {slot_size}")
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.arena_id = arena_id
        self.slot_size = slot_size
        self.num_slots = num_slots
        self._fd: int | None = fd
        self._mmap: mmap.mmap | None = mmap.mmap(fd, slot_size * num_slots)
        # A ctypes anchor gives the base address; it also pins the mapping while we use it.
        self._anchor: ctypes.c_char | None = ctypes.c_char.from_buffer(self._mmap)
        self._address = ctypes.addressof(self._anchor)

    @classmethod
    def create(cls, arena_id: int, slot_size: int, num_slots: int, *, label: str) -> Arena:
        """Create and reserve a new anonymous arena (worker side)."""
        size = slot_size * num_slots
        fd = os.memfd_create(label, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as error:
                if error.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                    raise SharedMemoryError(
                        f"cannot reserve {size} bytes ({size / 2**20:.1f} MiB) of shared memory "
                        f"for {num_slots} slots of {slot_size} bytes: {error.strerror}. "
                        "Free memory, lower `prefetch` or the batch size, or raise the memory "
                        "limit of this container."
                    ) from error
                if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
            return cls(fd, arena_id, slot_size, num_slots)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, fd: int, arena_id: int, slot_size: int, num_slots: int) -> Arena:
        """Map an arena received from a worker, then close the received descriptor."""
        try:
            arena = cls(fd, arena_id, slot_size, num_slots)
        except BaseException:
            os.close(fd)
            raise
        arena.close_fd()
        return arena

    @property
    def fd(self) -> int:
        if self._fd is None:
            raise ValueError("the arena's file descriptor is already closed")
        return self._fd

    @property
    def closed(self) -> bool:
        return self._mmap is None

    def close_fd(self) -> None:
        """Close the descriptor; the mapping stays valid (mmap keeps its own duplicate)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def slot_address(self, slot: int) -> int:
        if self._mmap is None:
            raise ValueError("arena is closed")
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range for {self.num_slots} slots")
        return self._address + slot * self.slot_size

    # ---------------------------------------------------------------- the writer region protocol
    def address(self, slot: int) -> int:
        return self.slot_address(slot)

    def finish_write(self, slot: int) -> None:
        """Host memory: the copy is done when ``copy_packed`` returns; nothing to record."""

    def copy_stream(self) -> int | None:
        return None

    def announce(self, channel: ControlChannel) -> None:
        """Send ``ArenaReady`` and the memfd; this side then closes its descriptor."""
        try:
            channel.send(ArenaReady(self.arena_id, self.slot_size, self.num_slots), fd=self.fd)
        finally:
            self.close_fd()

    # ---------------------------------------------------------------- the reader region protocol
    def arrays(self, slot: int, placements: Sequence[OutputPlacement]) -> tuple[list[Any], object]:
        """numpy views of every output of ``slot``; all hang off the returned :class:`SlotView`."""
        slot_view = self.slot_view(slot)
        base = np.asarray(slot_view)
        return [_output_arrays(base, p) for p in placements], slot_view

    def released(self, slot: int) -> None:
        """Host memory: nothing to fence."""

    def slot_view(self, slot: int) -> SlotView:
        """A buffer over one slot that keeps this arena's mapping alive while referenced."""
        address = self.slot_address(slot)
        assert self._anchor is not None
        return SlotView(self._anchor, address, self.slot_size)

    def write(self, slot: int, offset: int, data: bytes | memoryview) -> None:
        """Copy ``data`` into a slot at ``offset`` (used for tests and small payloads)."""
        if self._mmap is None:
            raise ValueError("arena is closed")
        start = slot * self.slot_size + offset
        if offset < 0 or offset + len(data) > self.slot_size:
            raise ValueError("write past the end of the slot")
        self._mmap[start : start + len(data)] = data

    def close(self) -> None:
        """Drop this side's descriptor and mapping. Idempotent."""
        self.close_fd()
        self._anchor = None
        mm, self._mmap = self._mmap, None
        if mm is not None:
            # Live views still export the buffer: the mapping then goes with the last of them.
            with contextlib.suppress(BufferError):
                mm.close()

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            self.close_fd()


def _output_arrays(base: np.ndarray[Any, Any], placement: OutputPlacement) -> Any:
    """One ``(B, ...)`` array for a dense output, else a list of per-sample arrays."""
    dtype = np.dtype(placement.dtype)
    raw = base[placement.offset : placement.offset + placement.nbytes]
    flat = raw.view(dtype) if placement.nbytes else np.empty(0, dtype)
    if placement.dense:
        count = len(placement.shapes)
        return flat.reshape((count, *(placement.shapes[0] if count else ())))
    arrays = []
    position = 0
    for shape in placement.shapes:
        size = math.prod(shape)
        arrays.append(flat[position : position + size].reshape(shape))
        position += size
    return arrays


def memfd_regions(name: str, owner: str, num_slots: int, limit: int | None) -> Any:
    """A region factory for :class:`ipc.SlotWriter`: memfd arenas named ``name``, together at
    most ``limit`` bytes (and never more than the memory available now, under the cgroup's memory
    limit too); errors name ``owner``."""
    from .limits import available_memory

    def create(arena_id: int, slot_size: int, needed: int) -> Arena:
        if limit is not None and slot_size * num_slots > limit:
            slot_size = max(needed, (limit // num_slots) // PAGE * PAGE)
        available = available_memory()
        if slot_size * num_slots > available:  # (headroom given up before what is needed)
            slot_size = needed
        total = needed * num_slots
        if limit is not None and total > limit:
            raise SharedMemoryError(
                f"{owner} needs {total} bytes ({total / 2**20:.1f} MiB: {num_slots} slots of "
                f"{needed} bytes) of shared memory, but shm_limit is {limit} bytes. Raise "
                "shm_limit, or lower prefetch or the batch size"
            )
        if total > available:
            raise SharedMemoryError(
                f"{owner} needs {total} bytes ({total / 2**20:.1f} MiB: {num_slots} slots of "
                f"{needed} bytes) of shared memory, but only {available} bytes "
                f"({available / 2**20:.1f} MiB) of memory are available{_under_limit()}, "
                "after what the job's other processes hold. Lower prefetch or the batch size, "
                "use fewer workers, or give the job more memory"
            )
        return Arena.create(arena_id, slot_size, num_slots, label=name)

    return create


def _under_limit() -> str:
    from .limits import memory_limit

    found = memory_limit()
    if found is None:
        return ""
    return (
        f" (under the memory limit of {found.limit / 2**20:,.0f} MiB of its cgroup, "
        f"{found.directory}, which counts the slots: a container's memory limit)"
    )


class SlotView:
    """A numpy-compatible byte buffer over one slot, holding its arena mapping alive.

    numpy collapses chains of views to the first object that is not an array, so every array made
    from ``np.asarray(slot_view)`` keeps *this* object alive; a ``weakref.finalize`` on it fires
    exactly when the last view of the slot is gone.
    """

    __slots__ = ("__array_interface__", "__weakref__", "_anchor")

    def __init__(self, anchor: ctypes.c_char, address: int, nbytes: int) -> None:
        # The anchor exports the mmap's buffer, so the mapping cannot be closed under this view.
        self._anchor = anchor
        self.__array_interface__ = {
            "data": (address, False),
            "shape": (nbytes,),
            "typestr": "|u1",
            "version": 3,
        }
