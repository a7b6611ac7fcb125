"""The walk over a job's shards that finds or makes the index of each one the summary does not
cover: each worker from its own place in the list, remote shards a few threads at a time, shards
another process of this node is indexing deferred until the others are done, and the progress
told to the trainer and logged by the lead worker. Runs in the worker.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

from ..plan import REPORT_PROGRESS
from ._index import TarIndex
from ._indexer import Indexer, Source
from ._listing import Listed

logger = logging.getLogger("workers")

#: Seconds between two progress lines of the lead worker while shards are indexed.
PROGRESS_EVERY = 10.0
#: Seconds of indexing before the lead worker's first progress line (a WARNING).
PROGRESS_FIRST = 5.0
#: Seconds between two ``wire.Starting`` records a worker sends the trainer while it indexes
#: shards (the trainer's startup wait counts it as alive while they come).
TELL_EVERY = 1.0
#: Remote shards whose indexes a worker finds (or makes) at once when it opens a dataset.
WALK_THREADS = 16


class WalkProgress:
    """What a walk over shards has done: told to the trainer about every :data:`TELL_EVERY`
    seconds (``wire.Starting`` through :data:`workers.sources.plan.REPORT_PROGRESS`: the worker
    is alive, and a walk is not its start-up), and by the ``lead`` worker in a log line every
    :data:`PROGRESS_EVERY` seconds (the first after :data:`PROGRESS_FIRST`): a WARNING naming
    the index command the first time (a walk that long is worth avoiding), then INFO."""

    def __init__(
        self, count: int, unindexed: int, indexer: Indexer, lead: bool, command: str
    ) -> None:
        self.count, self.indexer, self.lead, self.command = count, indexer, lead, command
        self.done = self.lines = 0
        self.started = self.told = self.shown = time.monotonic()
        self.doing = (
            f"indexing {count:,} tar shards ({unindexed:,} without an index: scanned)"
            if unindexed
            else f"reading the indexes of {count:,} tar shards"
        )
        self.report = REPORT_PROGRESS.get()
        self.tell()
        if lead and unindexed:
            logger.info(
                "%d of %d tar shards have no index: the workers index them before the first "
                "batch (each shard read whole, once, by one worker of one rank or another; "
                "progress every %g s). %s makes the indexes once, for every node and every job",
                unindexed,
                count,
                PROGRESS_EVERY,
                command,
            )

    def opened(self) -> None:
        """One more shard's index is ready."""
        self.done += 1
        self.tick()

    def tick(self) -> None:
        """Tell the trainer where the walk is, if it moved (shards done, bytes scanned) since
        it was last told: a store that answers nothing leaves the worker silent."""
        now = time.monotonic()
        if now - self.told >= TELL_EVERY and self.moved != self._where():
            self.tell()
        if self.lead and now - self.shown >= (PROGRESS_EVERY if self.lines else PROGRESS_FIRST):
            self.shown = now
            self.log(now - self.started)

    def _where(self) -> tuple[int, int]:
        return self.done, self.indexer.read_bytes

    def tell(self, waiting: str = "") -> None:
        """Tell the trainer now (and what the walk waits for, if it waits)."""
        self.told, self.moved = time.monotonic(), self._where()
        if self.report is not None:
            doing = f"{self.doing}, {waiting}" if waiting else self.doing
            self.report(doing, self.done, self.count, self.told - self.started)

    def log(self, seconds: float) -> None:
        left = (self.count - self.done) * seconds / max(1, self.done)
        line = (
            f"{self.doing}, before the first batch: {self.done:,} of {self.count:,} ready in "
            f"{seconds:.0f} s (this worker scanned {self.indexer.scanned:,}, "
            f"{self.indexer.scanned_bytes / 1e6:,.1f} MB), about {left:.0f} s left"
        )
        self.lines += 1
        if self.lines == 1:
            logger.warning(
                "%s. The workers of every rank share the work, and what they index is kept for "
                "the next start; %s indexes a dataset once, for every node and every job",
                line,
                self.command,
            )
        else:
            logger.info("%s", line)


def walk(
    urls: Sequence[str],
    listed: Listed,
    indexer: Indexer,
    shards: list[int],
    start: int,
    opened: Callable[[int, TarIndex], None],
    progress: WalkProgress,
) -> None:
    """Find or make the index of each of ``shards``, calling ``opened(k, index)`` for each; the
    walk starts at ``shards[start]`` (each worker at its own) and defers shards another process
    of this node is indexing until the others are done. Remote shards are taken
    :data:`WALK_THREADS` at a time (reading an ``.idx`` is a round trip; a scan a download)."""
    count = len(shards)
    pending = [shards[(start + k) % count] for k in range(count)]

    def get(k: int, wait: bool) -> _Got:
        return k, indexer.get(urls[k], listed.identities[k], listed=listed.listed_idx[k], wait=wait)

    threads = 1 if indexer.storage.local else min(WALK_THREADS, count)
    pool = ThreadPoolExecutor(threads, "tar-index") if threads > 1 else None
    try:
        while pending:
            deferred = _try_each(pending, get, pool, opened, progress)
            indexer.say_unsaid()  # (what the walk's threads found, from this thread)
            if len(deferred) == len(pending):  # nothing else to do: wait for the first one's lock
                progress.tell(f"waiting for {urls[deferred[0]]}, which another process indexes")
                k, found = get(deferred.pop(0), True)
                assert found is not None
                opened(k, found[0])
                progress.opened()
            pending = deferred
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)


_Got = tuple[int, tuple[TarIndex, Source] | None]


def _try_each(
    pending: list[int],
    get: Callable[[int, bool], _Got],
    pool: ThreadPoolExecutor | None,
    opened: Callable[[int, TarIndex], None],
    progress: WalkProgress,
) -> list[int]:
    """Find or make the index of each of ``pending`` (on ``pool``'s threads, taken as they
    complete: progress is told whichever shard is done first), without waiting for a shard
    another process of this node is indexing; returns those (deferred)."""
    deferred: list[int] = []

    def take(k: int, found: tuple[TarIndex, Source] | None) -> None:
        if found is None:
            deferred.append(k)
        else:
            opened(k, found[0])
            progress.opened()

    if pool is None:
        for k in pending:
            take(*get(k, False))
        return deferred
    queue = iter(pending)  # (a few in flight: each wait is over those only)
    running = {pool.submit(get, k, False) for k in itertools.islice(queue, 2 * WALK_THREADS)}
    while running:
        ready, running = wait(running, timeout=TELL_EVERY, return_when=FIRST_COMPLETED)
        for future in ready:
            take(*future.result())
            following = next(queue, None)
            if following is not None:
                running.add(pool.submit(get, following, False))
        progress.tick()  # (a large shard's scan moves while none is done)
    return deferred
