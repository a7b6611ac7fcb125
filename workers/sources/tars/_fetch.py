"""The fetches of remote shards' byte ranges a worker's epoch needs, made on background threads
shortly before the samples that need them (:class:`Fetcher`, the tar loader's). Runs in the
worker.

A worker reads a few shards at a time, of each one only its own contiguous piece, with one
request for that byte range (the next shards fetched while the current ones are halfway read, at
most ``ahead`` in advance and, past the first, at most ``ahead_bytes`` of them), never one request
per sample: an epoch reads each shard's bytes once, however many workers and ranks share it.
Memory per worker: the pieces of the groups in use plus what is fetched ahead.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

_Int64s = np.ndarray[Any, np.dtype[np.int64]]


class Fetcher:
    """Reads the byte ranges a worker's epoch needs of remote shards, on background threads,
    shortly before the samples that need them; a fetch first gets its shard's index.

    A shard is fetched when the batch being loaded needs it, or when it is at most ``lead`` steps
    away, fewer than ``ahead`` fetched shards wait to be needed and (past the first of them) the
    bytes of those waiting and of this one stay within ``ahead_bytes`` (``size(shard, rows)``:
    the bytes its rows are expected to take): a worker's first batch waits only for the shards
    it reads, and the next group's shards come while the current group is halfway read. A
    shard's bytes are dropped once its last batch is loaded.
    """

    def __init__(
        self,
        fetch: Callable[[int, _Int64s], tuple[int, np.ndarray[Any, Any]]],
        ahead: int,
        ahead_bytes: int | None = None,
        size: Callable[[int, _Int64s], int] | None = None,
    ) -> None:
        self.fetch, self.ahead, self.ahead_bytes = fetch, ahead, ahead_bytes
        self.size = size or (lambda _shard, rows: 0)
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._buffers: dict[int, tuple[int, Future[tuple[int, np.ndarray[Any, Any]]]]] = {}
        self._needs: list[tuple[int, int, int, _Int64s]] = []  # shard, first, last step, rows
        self._next = 0
        self._step = -1
        self._lead = 1
        self._kept: dict[int, Future[tuple[int, np.ndarray[Any, Any]]]] = {}

    def plan(self, needs: list[tuple[int, int, int, _Int64s]]) -> None:
        """A new epoch: ``needs`` (shard, first step, last step, its rows read) in the order the
        shards are first needed. A fetch made for the same rows of a shard is kept (an epoch
        planned again, as it is once the first batch has been traced)."""
        with self._lock:
            earlier = {shard: rows for shard, _first, _last, rows in self._needs}
            kept = {}
            for shard, _first, _last, rows in needs:
                held, before = self._buffers.get(shard), earlier.get(shard)
                if held is not None and before is not None and np.array_equal(before, rows):
                    kept[shard] = held[1]
            for shard, (_first, future) in self._buffers.items():
                if shard not in kept:
                    future.cancel()
            self._buffers.clear()
            self._kept = kept
            self._needs, self._next, self._step = needs, 0, -1
            spans = sorted(last - first + 1 for _shard, first, last, _rows in needs)
            self._lead = max(1, spans[len(spans) // 2] // 2) if spans else 1
            if self._pool is None:
                self._pool = ThreadPoolExecutor(4, "tar-fetch")
            self._schedule()

    def passed(self, step: int) -> None:
        with self._lock:
            self._step = step
            for shard, _first, last, _rows in self._needs[: self._next]:
                if last <= step:
                    self._buffers.pop(shard, None)
            if self._pool is not None:
                self._schedule()

    def _schedule(self) -> None:
        assert self._pool is not None
        loading = self._step + 1
        while self._next < len(self._needs):
            shard, first, _last, rows = self._needs[self._next]
            if first > loading and not self._may_fetch_ahead(first, loading, shard, rows):
                return
            future = self._kept.pop(shard, None) or self._pool.submit(self.fetch, shard, rows)
            self._buffers[shard] = (first, future)
            self._next += 1

    def _may_fetch_ahead(self, first: int, loading: int, shard: int, rows: _Int64s) -> bool:
        """Whether ``shard`` (first needed at step ``first``) may be fetched before the step
        ``loading`` needs it (see the class docstring)."""
        if first > loading + self._lead:
            return False
        needs = self._needs[: self._next]
        waiting = [(s, r) for s, f, _l, r in needs if f > loading and s in self._buffers]
        if len(waiting) >= self.ahead:
            return False
        if self.ahead_bytes is None or not waiting:
            return True
        held = sum(self.size(s, r) for s, r in waiting)
        return held + self.size(shard, rows) <= self.ahead_bytes

    def wait(self, shard: int) -> None:
        """Wait for the fetch of ``shard`` if one is under way (its errors are left to
        :meth:`get`)."""
        with self._lock:
            held = self._buffers.get(shard)
        if held is not None:
            wait([held[1]])

    def get(self, shard: int, start: int, end: int) -> np.ndarray[Any, Any] | None:
        """Bytes ``[start, end)`` of ``shard`` if they were fetched (waits for a fetch under
        way); None when they were not."""
        with self._lock:
            held = self._buffers.get(shard)
        if held is None:
            return None
        first, data = held[1].result()
        if start < first or end > first + len(data):
            return None
        return data[start - first : end - first]

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None
            self._buffers.clear()
            self._kept.clear()
