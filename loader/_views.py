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
    result: Any
    if kind == "dict":
        result = LoadedBatch(zip((p.name for p in descriptor.outputs), values, strict=False))
        result.info = info
    elif kind == "tuple":
        result = LoadedTuple(values)
        result.info = info
    else:
        result = values[0]
    return result, copy
