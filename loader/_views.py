"""Zero-copy views of a worker's slot, and the leases that give the slot back. Runs in the trainer.

A delivered batch's arrays all hang off one :class:`ipc.SlotView`. When the last of them (and of
the torch tensors made from them) is garbage-collected, a finalizer queues the slot's release in a
:class:`ReleaseQueue`; the trainer's thread sends it at its next wait. Finalizers never write to a
worker's channel themselves: they may run in any thread, or in the middle of another send.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from ipc import Arena
from ipc import _wire as wire


class ReleaseQueue:
    """Releases queued by finalizers, plus a pipe that wakes the trainer's wait."""

    def __init__(self) -> None:
        self._items: deque[tuple[int, int, int]] = deque()
        self._lock = threading.Lock()
        self._read_fd, self._write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._closed = False
        self._signalled = False
        #: Set by the trainer's thread from just before its last flush until its wait returns.
        self.waiting = False

    @property
    def wakeup_fd(self) -> int:
        return self._read_fd

    def put(self, worker: int, slot: int, generation: int) -> None:
        self._items.append((worker, slot, generation))
        # The trainer's thread flushes the queue before it waits; it needs waking only when it is
        # waiting already (or about to), or when the release comes from another thread.
        if not self.waiting and threading.current_thread() is threading.main_thread():
            return
        with self._lock:
            if not self._closed:
                self._signalled = True
                with contextlib.suppress(BlockingIOError, OSError):
                    os.write(self._write_fd, b"\0")

    def clear_wakeup(self) -> None:
        """Empty the wakeup pipe (the trainer's wait reported it readable)."""
        with self._lock:
            if self._closed:
                return
            self._signalled = False
            with contextlib.suppress(BlockingIOError, OSError):
                while os.read(self._read_fd, 4096):
                    pass

    def take(self) -> list[tuple[int, int, int]]:
        if self._signalled:
            self._signalled = False
            with contextlib.suppress(BlockingIOError, OSError):
                os.read(self._read_fd, 4096)
        items = []
        while self._items:
            items.append(self._items.popleft())
        return items

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.close(self._read_fd)
            os.close(self._write_fd)
        self._items.clear()


@dataclass(frozen=True, slots=True)
class BatchInfo:
    """Where a delivered batch came from. ``padded`` rows at its end are padding, not data."""

    epoch: int
    step: int
    worker: int
    shard: int
    padded: int

    @property
    def valid(self) -> int | None:
        return None if self.padded == 0 else -self.padded


class LoadedBatch(dict[str, Any]):
    """A delivered batch from a ``step`` that returned a dict: ``name -> array``."""

    info: BatchInfo


class LoadedTuple(tuple[Any, ...]):
    """A delivered batch from a ``step`` that returned a tuple."""

    info: BatchInfo


def wrap_outputs(kind: str, descriptor: wire.BatchReady, values: list[Any], info: BatchInfo) -> Any:
    """The user's batch: a LoadedBatch, a LoadedTuple, or the one output of a ``single`` step."""
    if kind == "dict":
        batch = LoadedBatch(zip((p.name for p in descriptor.outputs), values, strict=True))
        batch.info = info
        return batch
    if kind == "tuple":
        batch_tuple = LoadedTuple(values)
        batch_tuple.info = info
        return batch_tuple
    return values[0]


def _output_arrays(base: np.ndarray[Any, Any], placement: wire.OutputPlacement) -> Any:
    dtype = np.dtype(placement.dtype)
    raw = base[placement.offset : placement.offset + placement.nbytes]
    if placement.dense:
        count = len(placement.shapes)
        sample_shape = placement.shapes[0] if count else ()
        return raw.view(dtype).reshape((count, *sample_shape))
    arrays = []
    position = 0
    flat = raw.view(dtype) if placement.nbytes else np.empty(0, dtype)
    for shape in placement.shapes:
        size = 1
        for dim in shape:
            size *= dim
        arrays.append(flat[position : position + size].reshape(shape))
        position += size
    return arrays


def _convert(value: Any, output: str, copy: bool) -> Any:
    if isinstance(value, list):
        return [_convert(item, output, copy) for item in value]
    if copy:
        value = value.copy()
    if output == "torch":
        import torch

        return torch.from_numpy(value)
    return value


def build_batch(
    descriptor: wire.BatchReady,
    arena: Arena,
    kind: str,
    info: BatchInfo,
    *,
    output: str,
    copy: bool,
    releases: ReleaseQueue,
) -> tuple[Any, bool]:
    """The user's batch for ``descriptor``; the bool says the slot can be released at once."""
    slot_view = arena.slot_view(descriptor.slot)
    base = np.asarray(slot_view)
    values = [_convert(_output_arrays(base, p), output, copy) for p in descriptor.outputs]
    if not copy:
        finalizer = weakref.finalize(
            slot_view, releases.put, info.worker, descriptor.slot, descriptor.generation
        )
        finalizer.atexit = False
    del base, slot_view
    return wrap_outputs(kind, descriptor, values, info), copy


class _CudaLease:
    """Owner of one CUDA slot fill's arrays; its finalizer queues the slot's release."""

    __slots__ = ("__weakref__",)


def current_stream(output: str) -> Any:
    """``device_id -> handle`` of the trainer's current CUDA stream for the output library."""
    if output == "torch":
        import torch

        return lambda device_id: int(torch.cuda.current_stream(device_id).cuda_stream)
    import cupy

    def cupy_stream(device_id: int) -> int:
        with cupy.cuda.Device(device_id):
            return int(cupy.cuda.get_current_stream().ptr)

    return cupy_stream


def build_cuda_batch(
    descriptor: wire.BatchReady,
    importer: Any,
    kind: str,
    info: BatchInfo,
    *,
    output: str,
    copy: bool,
    releases: ReleaseQueue,
    stream: int,
) -> tuple[Any, bool]:
    """Device views (or device copies) of a CUDA slot fill, ordered after the worker's copy on
    ``stream`` (the trainer's current stream) without a host synchronisation."""
    import cupy

    importer.wait_ready(descriptor.slot, stream)
    owner = _CudaLease()
    values: list[Any] = []
    with cupy.cuda.Device(importer.device_id), cupy.cuda.ExternalStream(stream):
        for placement in descriptor.outputs:
            dtype = np.dtype(placement.dtype)
            if placement.dense:
                count = len(placement.shapes)
                shape = (count, *(placement.shapes[0] if count else ()))
                arrays: Any = importer.array(descriptor.slot, placement.offset, shape, dtype, owner)
            else:
                arrays = []
                offset = placement.offset
                for sample_shape in placement.shapes:
                    arrays.append(
                        importer.array(descriptor.slot, offset, sample_shape, dtype, owner)
                    )
                    size = dtype.itemsize
                    for dim in sample_shape:
                        size *= dim
                    offset += size
            if copy:
                arrays = [a.copy() for a in arrays] if isinstance(arrays, list) else arrays.copy()
            values.append(_to_output(arrays, output))
    if not copy:
        finalizer = weakref.finalize(
            owner, releases.put, info.worker, descriptor.slot, descriptor.generation
        )
        finalizer.atexit = False
    del owner
    return wrap_outputs(kind, descriptor, values, info), copy


def _to_output(value: Any, output: str) -> Any:
    if isinstance(value, list):
        return [_to_output(item, output) for item in value]
    if output == "torch":
        import torch

        return torch.from_dlpack(value)  # type: ignore[attr-defined]
    return value
