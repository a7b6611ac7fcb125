"""The queue of slot releases that any thread fills. Runs in the trainer.

A delivered batch's views keep its slot; when the last of them is collected, a finalizer (which
may run in any thread, or in the middle of another send) puts the slot's release here and, when
the trainer's thread waits or the release comes from another thread, wakes that wait through a
pipe. Nothing here decides when a release is sent: that is the policy of
:mod:`loader.engine._releases`, which takes what is queued.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from collections.abc import Iterator
from typing import Any


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
