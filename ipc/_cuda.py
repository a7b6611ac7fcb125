"""A CUDA slot ring shared between one worker and the trainer through CUDA IPC.

Runs in both processes; imports ``cupy`` only when a ring is made, so importing ``ipc`` never needs
CUDA. Same slots, generations and descriptors as the CPU arena (:mod:`ipc._ring`); only memory and
synchronisation differ:

* The worker (**exporter**) allocates every slot with plain ``cudaMalloc`` (not DALI's VMM pool,
  on which legacy IPC handles are not expected to work; not cupy's pool, which sub-allocates),
  2 MiB-aligned sizes, and exports each slot's memory handle and one interprocess "ready" event
  per slot, once.
* The trainer (**importer**) opens each handle once, and creates one interprocess "free" event per
  slot whose handles go back to the worker once.
* Worker, per batch: wait (on its copy stream, not the host) for the slot's "free" event, copy
  device-to-device into the slot, record "ready". Trainer, per batch: make its current stream wait
  for "ready" before any view is used; when the views die, record "free" on its current stream and
  send the release. No host synchronisation in the hot path on either side.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from ._arena import round_up

SLOT_ALIGN = 2 * 2**20
_LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess
_DEVICE_TO_DEVICE = 3  # cudaMemcpyDeviceToDevice


def _cupy() -> Any:
    try:
        import cupy
    except ImportError as error:
        raise ImportError(
            "GPU transport needs CuPy: pip install 'dali-capture-loader[gpu]' "
            "(or the cupy-cudaXXx build matching your CUDA)"
        ) from error
    return cupy


def cuda_slot_size(nbytes: int) -> int:
    return round_up(max(nbytes, 1), SLOT_ALIGN)


class CudaExporter:
    """The worker's side: owns the slots' memory and the "ready" events."""

    def __init__(self, arena_id: int, device_id: int, slot_size: int, num_slots: int) -> None:
        cp = _cupy()
        self._cp = cp
        self.arena_id = arena_id
        self.device_id = device_id
        self.slot_size = cuda_slot_size(slot_size)
        self.num_slots = num_slots
        self.pointers: list[int] = []
        self._ready: list[Any] = []
        self._free: list[int | None] = [None] * num_slots
        runtime = cp.cuda.runtime
        with cp.cuda.Device(device_id):
            try:
                self.stream = cp.cuda.Stream(non_blocking=True)
                for _ in range(num_slots):
                    self.pointers.append(int(runtime.malloc(self.slot_size)))
                    self._ready.append(
                        cp.cuda.Event(block=False, disable_timing=True, interprocess=True)
                    )
                self.memory_handles = tuple(
                    bytes(runtime.ipcGetMemHandle(p)) for p in self.pointers
                )
                self.ready_handles = tuple(
                    bytes(runtime.ipcGetEventHandle(e.ptr)) for e in self._ready
                )
            except BaseException:
                self.close()
                raise

    def set_free_events(self, handles: Sequence[bytes]) -> None:
        """Open the trainer's "free" events (sent once, before the first release)."""
        runtime = self._cp.cuda.runtime
        with self._cp.cuda.Device(self.device_id):
            self._free = [int(runtime.ipcOpenEventHandle(h)) for h in handles]

    def begin_write(self, slot: int) -> int:
        """Order the copy stream after the trainer's last use of ``slot``; returns its address."""
        free = self._free[slot]
        if free is not None:
            self._cp.cuda.runtime.streamWaitEvent(self.stream.ptr, free, 0)
        return self.pointers[slot]

    def copy_in(self, slot: int, offset: int, source_pointer: int, nbytes: int) -> None:
        if offset + nbytes > self.slot_size:
            raise ValueError(f"{nbytes} bytes at {offset} overflow a {self.slot_size}-byte slot")
        self._cp.cuda.runtime.memcpyAsync(
            self.pointers[slot] + offset, source_pointer, nbytes, _DEVICE_TO_DEVICE, self.stream.ptr
        )

    def finish_write(self, slot: int) -> None:
        """Record "ready": the trainer's stream will wait for it, not the host."""
        self._cp.cuda.runtime.eventRecord(self._ready[slot].ptr, self.stream.ptr)

    def close(self) -> None:
        cp = self._cp
        with contextlib.suppress(Exception), cp.cuda.Device(self.device_id):
            if self.pointers:
                self.stream.synchronize()
            for free in self._free:
                if free is not None:
                    cp.cuda.runtime.eventDestroy(free)
            for pointer in self.pointers:
                cp.cuda.runtime.free(pointer)
        self._free = [None] * self.num_slots
        self.pointers = []
        self._ready = []


class CudaImporter:
    """The trainer's side: opened slot memory, "ready" events to wait on, "free" events."""

    def __init__(
        self,
        arena_id: int,
        device_id: int,
        slot_size: int,
        memory_handles: Sequence[bytes],
        ready_handles: Sequence[bytes],
    ) -> None:
        cp = _cupy()
        self._cp = cp
        self.arena_id = arena_id
        self.device_id = device_id
        self.slot_size = slot_size
        self.num_slots = len(memory_handles)
        self.pointers: list[int] = []
        self._ready: list[int] = []
        runtime = cp.cuda.runtime
        with cp.cuda.Device(device_id):
            try:
                for handle in memory_handles:
                    self.pointers.append(int(runtime.ipcOpenMemHandle(handle, _LAZY_PEER_ACCESS)))
                self._ready = [int(runtime.ipcOpenEventHandle(h)) for h in ready_handles]
                self._free = [
                    cp.cuda.Event(block=False, disable_timing=True, interprocess=True)
                    for _ in range(self.num_slots)
                ]
                self.free_handles = tuple(
                    bytes(runtime.ipcGetEventHandle(e.ptr)) for e in self._free
                )
            except BaseException:
                self.close()
                raise

    def wait_ready(self, slot: int, stream_pointer: int) -> None:
        """Make ``stream_pointer`` (the trainer's current stream) wait for the worker's copy."""
        self._cp.cuda.runtime.streamWaitEvent(stream_pointer, self._ready[slot], 0)

    def mark_free(self, slot: int, stream_pointer: int) -> None:
        """Record "free" on the stream that used the slot's views last."""
        self._cp.cuda.runtime.eventRecord(self._free[slot].ptr, stream_pointer)

    def array(self, slot: int, offset: int, shape: tuple[int, ...], dtype: Any, owner: Any) -> Any:
        """A cupy array over part of a slot; ``owner`` is kept alive by the array."""
        cp = self._cp
        nbytes = int(cp.dtype(dtype).itemsize)
        for dim in shape:
            nbytes *= dim
        memory = cp.cuda.UnownedMemory(
            self.pointers[slot] + offset, max(nbytes, 1), owner, self.device_id
        )
        return cp.ndarray(shape, dtype=dtype, memptr=cp.cuda.MemoryPointer(memory, 0))

    def close(self) -> None:
        cp = self._cp
        with contextlib.suppress(Exception), cp.cuda.Device(self.device_id):
            cp.cuda.runtime.deviceSynchronize()
            for event in self._ready:
                cp.cuda.runtime.eventDestroy(event)
            for pointer in self.pointers:
                cp.cuda.runtime.ipcCloseMemHandle(pointer)
        self._ready = []
        self.pointers = []
