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
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ._arena import round_up
from ._layout import sample_offsets
from .wire import CudaFreeEvents, CudaRingReady, OutputPlacement

if TYPE_CHECKING:
    from ._channel import ControlChannel

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

    def __init__(
        self,
        arena_id: int,
        device_id: int,
        slot_size: int,
        num_slots: int,
        stream: int | None = None,
    ) -> None:
        """``stream``: the handle of the stream the batches are produced on (DALI's stream of
        the worker's EvalContext), so the copies into slots are ordered after them; a stream of
        the ring's own when None (tests without DALI)."""
        cp = _cupy()
        self._cp = cp
        self.arena_id = arena_id
        self.device_id = device_id
        self.slot_size = cuda_slot_size(slot_size)
        self.num_slots = num_slots
        self.pointers: list[int] = []
        self._ready: list[Any] = []
        self._free: list[int | None] = [None] * num_slots
        self._own_stream: Any = None
        runtime = cp.cuda.runtime
        with cp.cuda.Device(device_id):
            try:
                if stream is None:
                    self._own_stream = cp.cuda.Stream(non_blocking=True)
                    stream = int(self._own_stream.ptr)
                self.stream = stream
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

    # ---------------------------------------------------------------- the writer region protocol
    def address(self, slot: int) -> int:
        return self.begin_write(slot)

    def copy_stream(self) -> int | None:
        return self.stream

    def announce(self, channel: ControlChannel) -> None:
        channel.send(
            CudaRingReady(
                self.arena_id,
                self.device_id,
                self.slot_size,
                self.memory_handles,
                self.ready_handles,
            )
        )

    def set_free_events(self, handles: Sequence[bytes]) -> None:
        """Open the trainer's "free" events (sent once, before the first release)."""
        runtime = self._cp.cuda.runtime
        with self._cp.cuda.Device(self.device_id):
            self._free = [int(runtime.ipcOpenEventHandle(h)) for h in handles]

    def begin_write(self, slot: int) -> int:
        """Order the copy stream after the trainer's last use of ``slot``; returns its address."""
        free = self._free[slot]
        if free is not None:
            with self._cp.cuda.Device(self.device_id):
                self._cp.cuda.runtime.streamWaitEvent(self.stream, free, 0)
        return self.pointers[slot]

    def copy_in(self, slot: int, offset: int, source_pointer: int, nbytes: int) -> None:
        if offset + nbytes > self.slot_size:
            raise ValueError(f"{nbytes} bytes at {offset} overflow a {self.slot_size}-byte slot")
        self._cp.cuda.runtime.memcpyAsync(
            self.pointers[slot] + offset, source_pointer, nbytes, _DEVICE_TO_DEVICE, self.stream
        )

    def finish_write(self, slot: int) -> None:
        """Record "ready": the trainer's stream will wait for it, not the host."""
        with self._cp.cuda.Device(self.device_id):
            self._cp.cuda.runtime.eventRecord(self._ready[slot].ptr, self.stream)

    def close(self) -> None:
        cp = self._cp
        with contextlib.suppress(Exception), cp.cuda.Device(self.device_id):
            if self.pointers:
                cp.cuda.runtime.streamSynchronize(self.stream)
            for free in self._free:
                if free is not None:
                    cp.cuda.runtime.eventDestroy(free)
            for pointer in self.pointers:
                cp.cuda.runtime.free(pointer)
        self._free = [None] * self.num_slots
        self.pointers = []
        self._ready = []


class _CudaLease:
    """Owner of one CUDA slot fill's arrays; its collection means the fill's views are gone."""

    __slots__ = ("__weakref__",)


class CudaImporter:
    """The trainer's side: opened slot memory, "ready" events to wait on, "free" events."""

    def __init__(
        self,
        arena_id: int,
        device_id: int,
        slot_size: int,
        memory_handles: Sequence[bytes],
        ready_handles: Sequence[bytes],
        stream_of: Callable[[int], int] | None = None,
    ) -> None:
        """``stream_of(device_id)``: the trainer's current stream on that device, on which views
        are ordered after the worker's copy and on which "free" is recorded."""
        cp = _cupy()
        self._stream_of = stream_of
        self._delivered_on: dict[int, int] = {}  # slot -> stream its views were ordered on
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

    def send_free_events(self, channel: ControlChannel) -> None:
        channel.send(CudaFreeEvents(self.arena_id, self.free_handles))

    def wait_ready(self, slot: int, stream_pointer: int) -> None:
        """Make ``stream_pointer`` (a stream of the ring's device) wait for the worker's copy."""
        with self._cp.cuda.Device(self.device_id):
            self._cp.cuda.runtime.streamWaitEvent(stream_pointer, self._ready[slot], 0)

    def mark_free(self, slot: int, stream_pointer: int) -> None:
        """Record "free" on the stream that used the slot's views last (on the ring's device)."""
        with self._cp.cuda.Device(self.device_id):
            self._cp.cuda.runtime.eventRecord(self._free[slot].ptr, stream_pointer)

    # ---------------------------------------------------------------- the reader region protocol
    def _stream(self) -> int:
        if self._stream_of is None:
            raise RuntimeError("this CUDA ring was opened without a stream_of function")
        return self._stream_of(self.device_id)

    def arrays(self, slot: int, placements: Sequence[OutputPlacement]) -> tuple[list[Any], object]:
        """cupy views of every output of ``slot``, ordered after the worker's copy on the
        trainer's current stream (no host synchronisation); all keep the returned lease."""
        cp = self._cp
        stream = self._stream()
        self.wait_ready(slot, stream)
        self._delivered_on[slot] = stream
        owner = _CudaLease()
        values: list[Any] = []
        with cp.cuda.Device(self.device_id):
            for placement in placements:
                dtype = np.dtype(placement.dtype)
                if placement.dense:
                    count = len(placement.shapes)
                    shape = (count, *(placement.shapes[0] if count else ()))
                    values.append(self.array(slot, placement.offset, shape, dtype, owner))
                else:
                    offsets = sample_offsets(placement, dtype.itemsize)
                    values.append(
                        [
                            self.array(slot, offset, shape, dtype, owner)
                            for offset, shape in zip(offsets, placement.shapes, strict=True)
                        ]
                    )
        return values, owner

    def released(self, slot: int) -> None:
        """Record "free" on the stream that was current (on the ring's device) when the fill
        was delivered: the consumer contract is that the batch's views are used on that stream,
        or that a consumer on another stream synchronises with it (or passes copy=True)."""
        stream = self._delivered_on.pop(slot, None)
        self.mark_free(slot, self._stream() if stream is None else stream)

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
