"""When a batch's slot goes back to its worker. Runs in the trainer.

A delivered batch's views keep its slot; when the last of them is collected, a finalizer queues
the slot's release in the :class:`ReleaseQueue` (finalizers may run in any thread, so they never
write to a channel). :class:`Releases` decides which queued releases to send and when: one
record per worker, batched by half a ring while that costs the worker nothing, and at once for
``copy=True`` (the batch is a private copy). It returns records; the roster
(:mod:`loader.engine._roster`) sends them.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ipc import SlotReader, wire

if TYPE_CHECKING:
    from ._session import WorkerSession


class ReleaseQueue:
    """Releases queued by finalizers, plus a pipe that wakes the trainer's wait."""

    def __init__(self) -> None:
        self._items: deque[tuple[Any, int, int]] = deque()
        self._lock = threading.Lock()
        self._read_fd, self._write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._closed = False
        self._signalled = False
        #: Set by the trainer's thread from just before its last flush until its wait returns.
        self._waiting = False

    @property
    def wakeup_fd(self) -> int:
        return self._read_fd

    @contextlib.contextmanager
    def trainer_waiting(self) -> Iterator[None]:
        """Around the trainer's last flush and its wait: a release queued meanwhile, on any
        thread, wakes the wait."""
        self._waiting = True
        try:
            yield
        finally:
            self._waiting = False

    def put(self, owner: Any, slot: int, generation: int) -> None:
        """Queue the release of ``slot``'s fill ``generation`` of ``owner`` (the slot reader of
        the worker process that filled it: a replaced worker's stale releases are told apart)."""
        self._items.append((owner, slot, generation))
        # The trainer's thread flushes the queue before it waits; it needs waking only when it is
        # waiting already (or about to), or when the release comes from another thread.
        if not self._waiting and threading.current_thread() is threading.main_thread():
            return
        with self._lock:
            if not self._closed:
                self._signalled = True
                with contextlib.suppress(BlockingIOError, OSError):
                    os.write(self._write_fd, b"\0")

    def __bool__(self) -> bool:
        """True when a release is queued (or the wakeup pipe holds a signal to drain)."""
        return bool(self._items) or self._signalled

    def clear_wakeup(self) -> None:
        """Empty the wakeup pipe (the trainer's wait reported it readable)."""
        with self._lock:
            if self._closed:
                return
            self._signalled = False
            with contextlib.suppress(BlockingIOError, OSError):
                while os.read(self._read_fd, 4096):
                    pass

    def take(self) -> list[tuple[Any, int, int]]:
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


class Releases:
    """The release queue and the rule that batches what it sends."""

    def __init__(self) -> None:
        self.queue = ReleaseQueue()
        #: releases not sent yet, per slot reader (a replaced process's reader is dropped)
        self._pending: dict[SlotReader, list[tuple[int, int]]] = {}

    def due(
        self, sessions: Sequence[WorkerSession], *, lazy: bool
    ) -> list[tuple[int, wire.Release]]:
        """Queued releases to send now, as ``(worker, record)``, one record per worker.

        ``lazy`` keeps fewer than half a ring of a worker's releases queued while that costs
        nothing: the worker still has a free slot (or a batch on its way), or the trainer still
        holds a batch of it to deliver next. A busy trainer then wakes a blocked worker once per
        half ring rather than once per batch, and a starved one gets one release record per
        half ring (fewer, larger records both ways). A release a worker needs to go on is never
        held back, so waiting on a worker cannot deadlock."""
        pending = self._pending
        if not pending and not self.queue:
            return []
        for reader, slot, generation in self.queue.take():
            if sessions[reader.owner].reader is not reader:
                continue  # a fill of a replaced process: its slots went with it
            if reader.release(slot, generation):
                pending.setdefault(reader, []).append((slot, generation))
        records = []
        for reader in list(pending):
            session = sessions[reader.owner]
            fills = pending[reader]
            if session.reader is not reader:
                del pending[reader]  # the process was replaced: its slots went with it
                continue
            if (
                lazy
                and len(fills) < max(1, reader.num_slots // 2)
                and (session.queued or reader.held + len(fills) < reader.num_slots)
            ):
                continue
            del pending[reader]
            records.append((reader.owner, wire.Release(tuple(fills))))
        return records

    @staticmethod
    def now(reader: SlotReader, descriptor: wire.BatchReady) -> wire.Release | None:
        """The release of one fill, sent at once (a batch the trainer drops, or a private copy
        under ``copy=True``); None when it was released already."""
        if reader.release(descriptor.slot, descriptor.generation):
            return wire.Release(((descriptor.slot, descriptor.generation),))
        return None

    def close(self) -> None:
        self.queue.close()
