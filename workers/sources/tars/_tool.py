"""Indexing a whole dataset of tar shards at once: what ``python -m loader.tars index`` runs.

:func:`index_dataset` lists the shards' directories, skips the shards that are up to date (a
fresh entry in the summary, with an ``.idx`` beside the shard or the index in the entry), and
indexes the others. Small remote shards without an ``.idx`` (at most :data:`SMALL_SHARD` bytes)
are read whole on the store client's event loop, many at once, and scanned here
(:func:`_small_on_loop`). The rest go to a pool: for remote shards, :data:`THREADS` threads of
this process (the work is waiting on the store; the filesystem client is shared), for local
ones processes (spawned: reading a tar's headers from a local disk is the CPU's work). Each
finds the shard's ``.idx`` (checked against the shard) or scans the shard. An index made is
kept in the summary where its ``.idx`` text is at most :data:`INLINE_IDX` bytes (about a dozen
samples), else written beside the shard as ``.idx`` (every one with ``idx_files``: DALI's
``readers.webdataset`` reads them); the index command publishes: it is the one place, with
``publish_index=True``, that writes beside the data. The summary is written every
:data:`SAVE_EVERY` seconds and at the end, so an interrupted run leaves what it did usable, and a
second run finishes the job (shards whose index exists are read, not scanned). Library code:
progress goes to a callback (the CLI prints it), not to stdout.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from collections.abc import Callable, Iterable
from concurrent.futures import (
    FIRST_COMPLETED,
    Executor,
    Future,
    ProcessPoolExecutor,
    ThreadPoolExecutor,
    wait,
)
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ipc.limits import usable_cpus

from ..storage import RETRIES, Identity, read_each, storage_for
from ._index import TarIndex, load_cached, scan_bytes
from ._indexer import Indexer
from ._listing import check_urls, list_shards
from ._shards import shard_entries
from ._summary import INLINE_IDX, ShardEntry, read_summary, updated, write_summary
from ._wds_idx import format_idx

logger = logging.getLogger("workers")

#: Seconds between two saves of the summary while shards are indexed.
SAVE_EVERY = 30.0
#: Remote shards indexed at once, by default (threads of the index command's process).
THREADS = 32
#: Remote shards without an ``.idx`` of at most this many bytes are read on the event loop.
SMALL_SHARD = 4 << 20


@dataclass
class Indexed:
    """What one shard's indexing found (in a pool process)."""

    shard: int
    samples: int = 0
    keys: str = ""
    source: str = ""  # "idx", "cache" or "scan"
    scanned_bytes: int = 0
    wrote_beside: bool = True
    error: str = ""
    idx: str = ""  # its ``.idx`` text, kept in the summary instead of beside it


@dataclass
class Progress:
    """Where an :func:`index_dataset` run stands (given to its ``progress`` callback)."""

    total: int
    up_to_date: int = 0
    done: int = 0
    scanned: int = 0
    read_idx: int = 0
    from_cache: int = 0  # (indexes this node had made: written beside their shards)
    scanned_bytes: int = 0
    failed: list[str] = field(default_factory=list)
    not_beside: int = 0
    #: indexes kept in the summary instead of beside their shards
    inlined: int = 0
    started: float = field(default_factory=time.monotonic)
    summaries: list[str] = field(default_factory=list)
    samples: int = 0
    #: what indexes the shards (``32 threads``, ``2 processes``)
    pool: str = ""

    @property
    def finished(self) -> int:
        return self.up_to_date + self.done


def index_one(
    url: str,
    options: dict[str, Any] | None,
    retries: int,
    shard: int,
    identity: Identity,
    listed: bool | None,
    force: bool,
    inline_max: int = 0,
) -> Indexed:
    """Index one shard (run in a pool process): its ``.idx`` when it fits, else a scan; an
    index made whose ``.idx`` is at most ``inline_max`` bytes is given back for the summary,
    not written beside the shard."""
    storage = storage_for(url, options, retries)
    indexer = Indexer(storage, publish=True, inline_max=inline_max)
    try:
        found = indexer.get(
            url, identity, listed=listed, force=force, publish_cached=True, recheck=False
        )
    except (OSError, ValueError, EOFError) as error:
        return Indexed(shard, error=f"{type(error).__name__}: {error}")
    assert found is not None
    index, source = found
    return Indexed(
        shard,
        index.samples,
        index.keys_hash,
        source,
        indexer.scanned_bytes,
        wrote_beside=indexer.writable,
        idx=indexer.inlined.get(url, ""),
    )


def index_dataset(
    urls: str | Iterable[str],
    storage_options: dict[str, Any] | None = None,
    *,
    processes: int | None = None,
    threads: int | None = None,
    force: bool = False,
    retries: int = RETRIES,
    progress: Callable[[Progress], None] | None = None,
    idx_files: bool = False,
) -> Progress:
    """Index every shard of ``urls`` and write the summary (see the module docstring):
    ``threads`` at once for remote shards (default :data:`THREADS`), ``processes`` for local
    ones (default: the CPUs this process may use). A shard's index of at most
    :data:`INLINE_IDX` bytes of ``.idx`` is kept in the summary, not written beside it, unless
    ``idx_files`` (every one beside: DALI's ``readers.webdataset`` reads ``.idx`` files)."""
    expanded = check_urls(urls, storage_options, retries)
    job = _IndexJob(expanded, storage_options, retries, 0 if idx_files else INLINE_IDX)
    todo = job.plan(force)
    if not job.storage.local:
        todo = _small_on_loop(job, todo, threads or THREADS, force, progress)
    pool, workers = pool_for(job.storage.local, len(todo), processes, threads)
    kind = "processes" if job.storage.local else "threads"
    job.state.pool = f"indexing {len(todo)} with {workers} {kind}"
    if progress is not None:
        progress(job.state)
    job.run(todo, pool, workers, force, progress)
    job.state.samples = int(job.counts[job.done].sum())
    if progress is not None:
        progress(job.state)
    return job.state


def pool_for(
    local: bool, count: int, processes: int | None, threads: int | None
) -> tuple[Executor, int]:
    """The pool that indexes ``count`` shards, and its size: processes for local shards,
    threads for remote ones."""
    if local:
        workers = max(1, min(processes or usable_cpus(), count or 1))
        return ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn")
        ), workers
    workers = max(1, min(threads or THREADS, count or 1))
    return ThreadPoolExecutor(workers, "tar-index"), workers


class _IndexJob:
    """One run of :func:`index_dataset`: what is known of every shard, and the summaries."""

    def __init__(
        self,
        expanded: list[str],
        storage_options: dict[str, Any] | None,
        retries: int,
        inline_max: int,
    ) -> None:
        """``inline_max``: the longest ``.idx`` kept in the summary (0: none)."""
        self.expanded, self.retries, self.inline_max = expanded, retries, inline_max
        self.options = dict(storage_options or {})
        self.storage = storage_for(expanded[0], storage_options, retries)
        self.listed = list_shards(self.storage, expanded)
        count = len(expanded)
        self.counts = np.zeros(count, dtype=np.int64)
        self.hashes = [""] * count
        #: per shard, the ``.idx`` text the summary keeps of it ("": beside it)
        self.indexes = [""] * count
        self.done = np.zeros(count, dtype=bool)
        self.summaries = {
            d: read_summary(self.storage, d, listing) for d, listing in self.listed.listings.items()
        }
        self.state = Progress(count)

    def plan(self, force: bool) -> list[int]:
        """The shards to index: those the summary does not cover as they are now (all with
        ``force``); the others are counted as up to date."""
        storage, listed, todo = self.storage, self.listed, []
        for k, url in enumerate(self.expanded):
            summary = self.summaries[storage.dirname(url)]
            entry = None if summary is None else summary[0].get(storage.basename(url))
            fresh = entry is not None and entry.identity == listed.identities[k]
            kept = fresh and entry is not None and bool(entry.idx) and self.inline_max > 0
            if fresh and (listed.listed_idx[k] or kept) and not force:
                assert entry is not None
                self.counts[k], self.hashes[k], self.done[k] = entry.samples, entry.keys, True
                self.indexes[k] = entry.idx if kept else ""
                self.state.up_to_date += 1
            else:
                todo.append(k)
        return todo

    def save(self) -> None:
        """Write every directory's summary with what is done so far."""
        indices = np.flatnonzero(self.done).tolist()
        entries = shard_entries(
            self.storage,
            [self.expanded[k] for k in indices],
            self.counts[self.done],
            [self.hashes[k] for k in indices],
            [self.listed.identities[k] for k in indices],
            [self.indexes[k] for k in indices],
        )
        self.state.summaries = []
        for directory, new in entries.items():
            summary = self.summaries[directory]
            old: dict[str, ShardEntry] = {} if summary is None else summary[0]
            merged = updated(old, new, self.listed.listings[directory])
            self.state.summaries.append(write_summary(self.storage, directory, merged, beside=True))

    def submit(self, pool: Executor, k: int, force: bool) -> Future[Indexed]:
        listed = self.listed
        return pool.submit(
            index_one,
            self.expanded[k],
            self.options,
            self.retries,
            k,
            listed.identities[k],
            listed.listed_idx[k],
            force,
            self.inline_max,
        )

    def run(
        self,
        todo: list[int],
        pool: Executor,
        workers: int,
        force: bool,
        progress: Callable[[Progress], None] | None,
    ) -> None:
        """Index ``todo`` on ``pool``, saving the summaries every :data:`SAVE_EVERY` seconds
        and at the end (also when interrupted); ``progress`` is told at least every second."""
        saved = time.monotonic()
        ahead = 4 * workers
        with pool:
            pending: set[Future[Indexed]] = set()
            queue = iter(todo)
            try:
                while True:
                    for k in queue:  # keep the pool a little ahead of its workers
                        pending.add(self.submit(pool, k, force))
                        if len(pending) >= ahead:
                            break
                    if not pending:
                        break
                    finished, pending = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
                    for future in finished:
                        _record(future.result(), self)
                    saved = self.tick(saved, progress)
            except BaseException:
                self.interrupted(pending)
                raise
        if self.state.done:
            self.save()

    def tick(self, saved: float, progress: Callable[[Progress], None] | None) -> float:
        """Save the summaries when :data:`SAVE_EVERY` seconds passed since ``saved`` (and
        something is done), tell ``progress``; when the summaries were saved last."""
        if time.monotonic() - saved > SAVE_EVERY and self.done.any():
            self.save()
            saved = time.monotonic()
        if progress is not None:
            progress(self.state)
        return saved

    def interrupted(self, pending: Iterable[Future[Any]]) -> None:
        """Stopped (an error, ^C): cancel ``pending``, save what is done."""
        for future in pending:
            future.cancel()
        if self.state.done:
            self.save()


def _small_on_loop(
    job: _IndexJob,
    todo: list[int],
    at_once: int,
    force: bool,
    progress: Callable[[Progress], None] | None,
) -> list[int]:
    """Index the small remote shards of ``todo`` without an ``.idx`` beside them (at most
    :data:`SMALL_SHARD` bytes: the request is the cost, not the bytes): this node's cached
    index where it has one, else the shard read whole on the store client's event loop
    (``at_once`` in flight; its identity checked by the GET itself, as a thread's scan checks
    it) and scanned here (``force``: every one read and scanned); its ``.idx`` kept for the
    summary or, too long for it, written beside the shard by a few threads. No thread, lock
    or cache file a shard (for 10,000 shards, the command's CPU; :mod:`bench.index_scale`).
    The shards left, for the pool."""
    listed, storage = job.listed, job.storage
    small = [
        k for k in todo if listed.listed_idx[k] is False and listed.identities[k][0] <= SMALL_SHARD
    ]
    if not small:
        return todo
    indexer = Indexer(storage, publish=True, inline_max=job.inline_max)
    reads, saved = [], time.monotonic()
    for k in small:
        cached = None if force else load_cached(storage, job.expanded[k], listed.identities[k])
        if cached is not None and not cached.damage:
            _record(_kept(job, k, cached, "cache", indexer, None), job)
        else:
            reads.append(k)
    urls = [(job.expanded[k], 0, listed.identities[k][0]) for k in reads]
    identities = [listed.identities[k] for k in reads]
    with ThreadPoolExecutor(8, "idx-writes") as writes:
        pending: list[Future[Indexed]] = []
        try:
            for number, found in read_each(storage, urls, at_once, identities):
                k = reads[number]
                _record(_scanned(job, k, found, indexer, writes, pending), job)
                for future in [f for f in pending if f.done()]:
                    pending.remove(future)
                    _record(future.result(), job)
                saved = job.tick(saved, progress)
            for future in pending:
                _record(future.result(), job)
        except BaseException:
            job.interrupted(pending)
            raise
    done = set(small)
    return [k for k in todo if k not in done]


def _scanned(
    job: _IndexJob,
    k: int,
    found: bytes | Exception,
    indexer: Indexer,
    writes: Executor,
    pending: list[Future[Indexed]],
) -> Indexed | None:
    """Shard ``k``'s index from its bytes (``found``: or the error its read ended in); None
    when its ``.idx`` goes beside it (a write in ``pending``, recorded when it is done)."""
    if isinstance(found, Exception):
        return Indexed(k, error=f"{type(found).__name__}: {found}")
    url = job.expanded[k]
    index, damage = scan_bytes(url, found)
    if damage is not None:
        return Indexed(k, error=f"ValueError: {damage}")
    logger.info("indexed %s: %d samples", url, index.samples)
    return _kept(job, k, index, "scan", indexer, (writes, pending))


def _kept(
    job: _IndexJob,
    k: int,
    index: TarIndex,
    source: str,
    indexer: Indexer,
    writes: tuple[Executor, list[Future[Indexed]]] | None,
) -> Indexed | None:
    """What indexing shard ``k`` found (``index``, from ``source``): its ``.idx`` kept for the
    summary where it is short enough, else written beside the shard (on ``writes``' threads,
    its result added to their list: None here; without them, now)."""
    url, identity = job.expanded[k], job.listed.identities[k]
    scanned = identity[0] if source == "scan" else 0
    text = format_idx(index)
    found = Indexed(k, index.samples, index.keys_hash, source, scanned)
    found.idx = indexer.inline(url, text)
    if found.idx:
        return found

    def write() -> Indexed:
        indexer.keep_text(url, index, identity, text)
        found.wrote_beside = indexer.writable
        return found

    if writes is None:
        return write()
    writes[1].append(writes[0].submit(write))
    return None


def _record(result: Indexed | None, job: _IndexJob) -> None:
    if result is None:
        return
    state = job.state
    state.done += 1
    if result.error:
        state.failed.append(f"{job.expanded[result.shard]}: {result.error}")
        return
    k = result.shard
    job.counts[k], job.hashes[k], job.done[k] = result.samples, result.keys, True
    job.indexes[k] = result.idx
    state.inlined += bool(result.idx)
    if result.source == "scan":
        state.scanned += 1
        state.scanned_bytes += result.scanned_bytes
    elif result.source == "cache":
        state.from_cache += 1
    else:
        state.read_idx += 1
    if not result.wrote_beside:
        state.not_beside += 1
