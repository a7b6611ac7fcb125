"""A set of tar shards opened for a job: their sample counts, from as few requests as the store
allows. Runs in the worker (and in ``python -m loader.tars index``).

Where a shard's facts come from, cheapest first:

1. the directory's summary (:mod:`._summary`): one request for every shard it covers (once per
   node: :func:`~._listing.node_summary`). Where it names every remote shard asked for, it is the
   directory's listing: no listing is made, and each shard's identity is checked when the shard
   is read, by that read (:func:`~._listing.start_facts`, :meth:`TarShards.changed`); elsewhere
   each entry is checked against the directory's listing (one request per 1,000 objects on S3);
2. the shard's ``.idx`` beside it (DALI's ``wds2idx`` format, :mod:`._wds_idx`), or this node's
   cached copy of its index: one small request, or none;
3. a scan of the shard (:func:`workers.sources.tars._index.scan`): the whole shard, read once.

Opening a job's shards (:func:`open_shards`) reads the summary (and the listing, where it is
needed), and only for the shards the summary does not cover (or covers stale) goes to 2 and 3;
a worker fetches a shard's index only when it is about to read that shard (:meth:`Indexer.get`,
from the tar loader). Reading never writes where the data lives unless asked: an index made by
a scan is kept in this node's cache, and the job's lead worker (shard 0) keeps the summary there
too, so the node's next start scans nothing; ``publish=True`` (``publish_index=True`` of the
dataset) writes both beside the shards instead, as ``python -m loader.tars index`` does, so
that every node starts with a few requests.

Many workers open the same shards at once. Each walks them from its own place (its shard's share
of the list), so the shards without an index are scanned by all workers together: on one node a
shard is taken by the first worker to hold its lock (the others go on and come back); across
nodes, a worker checks for an ``.idx`` written meanwhile before it scans.
"""

from __future__ import annotations

import hashlib
import logging
import posixpath
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..plan import encode_parts
from ..storage import (
    RETRIES,
    Identity,
    Storage,
    StorageFailure,
    storage_for,
)
from ._index import TarIndex, scan_bytes
from ._indexer import Indexer, index_command
from ._listing import Listed, check_urls, places_of, start_facts
from ._summary import (
    ShardEntry,
    describe_stale,
    stale_reason,
    updated,
    write_summary,
)
from ._walk import WalkProgress, walk
from ._wds_idx import fits, idx_url, parse_idx

logger = logging.getLogger("workers")

_Int64s = np.ndarray[Any, np.dtype[np.int64]]


@dataclass
class TarShards:
    """A set of tar shards, opened: their sample counts (and where each one's ids start), keys'
    hashes and identities as listed at the start."""

    urls: list[str]
    storage: Storage
    counts: _Int64s
    starts: _Int64s  # the first sample id of each shard, and the total
    keys_hashes: list[str]
    identities: list[Identity]
    #: whether the listing showed an ``.idx`` beside each shard (None: not known)
    listed_idx: list[bool | None]
    #: shards that are not whole, under ``on_error="skip"``: the index of their samples before
    #: the damage (what the job reads of them; its ``damage`` says what is wrong)
    damaged: dict[int, TarIndex] = field(default_factory=dict)
    #: per shard, the summary its identity comes from, until the store confirms it (no listing
    #: was made: :func:`start_facts`); None: a listing told it
    vouched: list[str | None] = field(default_factory=list)
    #: per shard, the summary its sample count and keys come from (what the epochs are planned
    #: with); None: its index told them
    planned_from: list[str | None] = field(default_factory=list)
    #: the indexes made while reading are written beside their shards (``publish_index=True``),
    #: not only kept in this node's cache
    publish: bool = False
    #: per shard, the ``.idx`` text its summary keeps ("": none; the index is fetched or made)
    inline: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return int(self.starts[-1])

    def shard_of(self, ids: np.ndarray[Any, Any]) -> _Int64s:
        found: _Int64s = np.searchsorted(self.starts, ids, side="right") - 1
        return found

    def fingerprint(self) -> str:
        """``tars:`` and a hash of the shards' names (not where they are kept), sizes, sample
        counts and keys: the same dataset copied to an object store keeps its fingerprint, and
        shards rewritten with the same names and keys but other bytes (a re-export) change it
        (the sizes come with the listing: nothing more is read)."""
        digest = hashlib.sha256()
        rows = zip(self.urls, self.identities, self.counts.tolist(), self.keys_hashes, strict=True)
        for url, (size, _version), count, keys in rows:
            digest.update(f"{posixpath.basename(url)}\0{size}\0{count}\0{keys}\n".encode())
        return f"tars:{digest.hexdigest()[:16]}"

    def parts(self) -> str:
        """Each shard's name, size and samples, for a state (:mod:`sources.plan._parts`)."""
        rows = zip(self.urls, self.identities, self.counts.tolist(), strict=True)
        return encode_parts(
            "shard", [(posixpath.basename(url), size, count) for url, (size, _v), count in rows]
        )

    def left_out(self) -> tuple[str, ...]:
        """A line per damaged shard (``on_error="skip"``): what is wrong, what of it is read."""
        return tuple(
            f"{index.damage} ({_read_of(index, self.identities[k][0])})"
            for k, index in sorted(self.damaged.items())
        )

    def index(self, shard: int, indexer: Indexer) -> TarIndex:
        """The index of ``shard``, fetched now (a worker about to read it); ``StorageFailure``
        when it no longer matches what the epoch was planned with (naming the shard)."""
        url = self.urls[shard]
        if shard in self.damaged:
            return self.damaged[shard]
        kept = self._kept_index(shard)
        if kept is not None:
            return kept
        identity, listed = self.identities[shard], self.listed_idx[shard]
        vouched = self.vouched[shard] if self.vouched else None
        found = indexer.get(url, identity, listed=listed, probe=False, scan=vouched is None)
        if found is None:  # (no index fits the summary's entry: the shard changed since?)
            self.confirm(shard)
            found = indexer.get(url, identity, listed=listed, probe=False)
        assert found is not None  # (wait=True)
        index, source = found
        if not self._matches(shard, index) and source != "scan":
            self.confirm(shard)
            told = "this node's cache" if source == "cache" else idx_url(url)
            indexer.warn(
                f"the index of {url} (from {told}) disagrees with the dataset's summary: "
                "scanning it"
            )
            found = indexer.get(url, identity, force=True)
            assert found is not None
            index = found[0]
        if not self._matches(shard, index):
            raise self.mismatch(shard, index)
        return index

    def _kept_index(self, shard: int) -> TarIndex | None:
        """The index the summary keeps of ``shard`` (no request), when it keeps one that parses,
        fits the shard's size and agrees with the entry's samples and keys; else None (the
        index is fetched or made, and a disagreement named, as for an ``.idx``)."""
        text = self.inline[shard] if self.inline else ""
        if not text:
            return None
        url, where = self.urls[shard], self.planned_from[shard] if self.planned_from else None
        try:
            index = parse_idx(url, f"{where} (its index of {url})", text.encode())
        except ValueError as error:
            logger.warning("ignored the index the summary keeps: %s", error)
            return None
        if not fits(index, self.identities[shard][0]) or not self._matches(shard, index):
            return None
        return index

    def mismatch(self, shard: int, index: TarIndex, told_by: str | None = None) -> StorageFailure:
        """The error for ``index``, made from the shard's own bytes, when it is not what this
        job planned the shard with: the shard changed since (its identity, asked of the store
        again), else the summary the plan came from is wrong about it, else ``told_by`` (the
        ``.idx`` the plan came from) is."""
        url = self.urls[shard]
        holds = f"{index.samples} samples (keys {index.keys_hash})"
        planned = f"{int(self.counts[shard])} samples (keys {self.keys_hashes[shard]})"
        found = self.storage.identity(url)
        if found != self.identities[shard]:
            return self.changed(shard, found)
        size, version = found
        where = self.planned_from[shard] if self.planned_from else None
        if where is not None:
            return StorageFailure(
                f"the summary {where} is wrong about {url}: it says the shard holds {planned}, "
                f"the shard holds {holds}, and it is the shard the summary names ({size} "
                f"bytes, {version}): the summary was edited, or written for other data. This "
                f"job planned its epochs with it. Run {index_command(url, force=True)} (it "
                "indexes the shard again and rewrites its entry in the summary), then restart "
                "the job"
            )
        if told_by is not None:
            mended = (
                f"{told_by} was written again from the shard's bytes (where the store allows it)"
                if self.publish
                else f"The shard's index was made from its bytes (kept in this node's cache); "
                f"{index_command(url, force=True)} writes {told_by} again"
            )
            return StorageFailure(
                f"{told_by} is wrong about {url}: it lists {planned}, the shard holds {holds}, "
                f"and this job planned its epochs with it. {mended}: restart the job (a state "
                "saved before may be refused over the shard)"
            )
        return StorageFailure(
            f"{url} holds {holds}, not the {planned} this job planned with: the shard changed "
            "while the job runs. Restart the job (a saved state refuses a changed dataset) "
            f"after {index_command(url)}"
        )

    def index_of_bytes(self, shard: int, data: np.ndarray[Any, Any]) -> TarIndex | None:
        """The index of ``shard`` scanned from its whole bytes (read by a worker that needs every
        sample of it: no ``.idx`` to fetch), when it is the index the epoch was planned with;
        None when it is not (the ``.idx`` path then decides: a warning, a rescan, an error)."""
        if shard in self.damaged:
            return None
        index, damage = scan_bytes(self.urls[shard], data.tobytes())
        return index if damage is None and self._matches(shard, index) else None

    def confirm(self, shard: int) -> None:
        """Ask the store for the identity of a shard known from the summary only (one HEAD);
        :meth:`changed` when it differs."""
        if not self.vouched or self.vouched[shard] is None:
            return
        found = self.storage.identity(self.urls[shard])
        if found != self.identities[shard]:
            raise self.changed(shard, found)
        self.vouched[shard] = None

    def changed(self, shard: int, found: Identity) -> StorageFailure:
        """The error for a shard the store now has as ``found``, not as the job planned it."""
        url, (size, version) = self.urls[shard], self.identities[shard]
        why = stale_reason(ShardEntry(size, version, 0, ""), found)
        where = self.vouched[shard] if self.vouched else None
        if where is None:
            return StorageFailure(
                f"{url} changed while the job runs ({why}). Restart the job (a saved state "
                f"refuses a changed dataset) after {index_command(url)}"
            )
        return StorageFailure(
            f"{url} changed since it was indexed ({why}): the summary {where} that this job "
            "planned its epochs with is stale for it. Run "
            f"{index_command(url)} (it indexes the changed shard and rewrites the summary), "
            "then restart the job (a state saved before may be refused over the changed shard)"
        )

    def agrees(self, shard: int, index: TarIndex) -> bool:
        """Whether ``index`` is what this job planned ``shard`` with (its samples and keys)."""
        return self._matches(shard, index)

    def _matches(self, shard: int, index: TarIndex) -> bool:
        return index.samples == self.counts[shard] and index.keys_hash == self.keys_hashes[shard]


def open_shards(
    urls: str | Iterable[str],
    storage_options: dict[str, Any] | None,
    start_fraction: float,
    retries: int = RETRIES,
    *,
    lead: bool = False,
    skip_damaged: bool = False,
    publish: bool = False,
) -> TarShards:
    """Expand, check and open the shards (see the module docstring). Shards the summary does not
    cover are indexed walking from ``start_fraction`` of them. The ``lead`` worker (one per job)
    names a stale summary, reports progress and keeps the summary in this node's cache when it
    had to look past it (``publish``: writes it, and the indexes made, beside the shards).
    ``skip_damaged`` (``on_error="skip"``): a shard that is not whole gives its samples before
    the damage (the ``lead`` worker warns, naming it) instead of failing the start."""
    expanded = check_urls(urls, storage_options, retries)
    storage = storage_for(expanded[0], storage_options, retries)
    places = places_of(storage, expanded)
    listed, summaries = start_facts(storage, expanded, places)
    count = len(expanded)
    counts = np.zeros(count, dtype=np.int64)
    hashes, inline = [""] * count, [""] * count
    planned: list[str | None] = [None] * count
    rest: list[int] = []
    stale: dict[str, list[tuple[int, ShardEntry]]] = {}
    for k, (directory, name) in enumerate(places):
        summary = summaries[directory]
        entry = None if summary is None else summary[0].get(name)
        if entry is not None and summary is not None and entry.identity == listed.identities[k]:
            counts[k], hashes[k], planned[k] = entry.samples, entry.keys, summary[1]
            inline[k] = entry.idx
            continue
        if entry is not None and summary is not None:
            stale.setdefault(summary[1], []).append((k, entry))
        rest.append(k)
    if lead:
        for where, entries in stale.items():
            _report_stale(where, entries, expanded, listed, storage, urls, publish)
    if not rest:
        shards = _opened(expanded, storage, counts, hashes, listed)
        shards.planned_from, shards.publish, shards.inline = planned, publish, inline
        return shards
    indexer = Indexer(storage, skip_damaged=skip_damaged, publish=publish)

    def opened(k: int, index: TarIndex) -> None:
        counts[k], hashes[k] = index.samples, index.keys_hash

    started = time.monotonic()
    unindexed = sum(1 for k in rest if listed.listed_idx[k] is False)
    progress = WalkProgress(len(rest), unindexed, indexer, lead, index_command(urls))
    walk(expanded, listed, indexer, rest, int(start_fraction * len(rest)), opened, progress)
    shards = _after_walk(
        urls, expanded, storage, counts, hashes, listed, summaries, rest, indexer, lead, started
    )
    shards.planned_from, shards.publish, shards.inline = planned, publish, inline
    return shards


def _after_walk(
    given: str | Iterable[str],
    urls: list[str],
    storage: Storage,
    counts: _Int64s,
    hashes: list[str],
    listed: Listed,
    summaries: dict[str, tuple[dict[str, ShardEntry], str] | None],
    walked: list[int],
    indexer: Indexer,
    lead: bool,
    started: float,
) -> TarShards:
    """The shards once the indexes of ``walked`` were found or made: the ``lead`` worker says
    what the walk cost and which shards are damaged, and keeps (or publishes) the summary."""
    unindexed = sum(1 for k in walked if listed.listed_idx[k] is False)
    if lead and unindexed:
        logger.info(
            "%d of %d shards had no index: the workers indexed them (%.1f s; this worker "
            "scanned %d, %.1f MB). %s indexes a dataset once, for every node and every job",
            unindexed,
            len(urls),
            time.monotonic() - started,
            indexer.scanned,
            indexer.scanned_bytes / 1e6,
            index_command(given),
        )
    number = {url: k for k, url in enumerate(urls)}
    damaged = {number[url]: found for url, found in indexer.damaged.items()}
    if lead:
        for k, index in sorted(damaged.items()):
            _warn_damaged(index, listed.identities[k][0])
        kept = [k for k in range(len(urls)) if k not in damaged]  # (no summary vouches for those)
        _write_summaries(storage, urls, counts, hashes, listed, summaries, kept, indexer.publish)
    shards = _opened(urls, storage, counts, hashes, listed)
    shards.damaged = damaged
    return shards


def _read_of(index: TarIndex, size: int) -> str:
    """What is read of a damaged shard whose whole samples ``index`` holds, and where what is
    left out of it starts."""
    if not index.samples:
        return "none of its samples is read; all of it is left out"
    left = f", from {index.left_from}," if index.left_from else ""
    return (
        f"its first {index.samples} samples are read (up to byte {index.data_end} of {size}); "
        f"the rest of it{left} is left out"
    )


def _warn_damaged(index: TarIndex, size: int) -> None:
    """Say once per job (the lead worker) what a damaged shard gives under on_error="skip"."""
    warnings.warn(
        f"on_error='skip': {index.damage}. {_read_of(index, size)} of every epoch until the "
        "shard is rewritten (a state saved now is refused over the rewritten shard; "
        "loader.stats().left_out lists such shards)",
        stacklevel=3,
    )


def _report_stale(
    where: str,
    entries: list[tuple[int, ShardEntry]],
    urls: list[str],
    listed: Listed,
    storage: Storage,
    given: str | Iterable[str],
    publish: bool,
) -> None:
    """Name the shards a summary is stale for: a warning, unless only the kind of version
    differs (mtimes where the store now gives ETags: the shards were copied, not changed)."""
    shards = [
        (storage.basename(urls[k]), stale_reason(entry, listed.identities[k]))
        for k, entry in entries
    ]
    copied = all(
        entry.size == listed.identities[k][0]
        and entry.version.partition(":")[0] != listed.identities[k][1].partition(":")[0]
        for k, entry in entries
    )
    if copied:
        logger.info(
            "the summary %s was written where the shards had other versions (%s): copied? "
            "Their .idx files are checked once and the summary %s (%s rewrites it beside them)",
            where,
            describe_stale(shards, 1),
            "rewritten" if publish else "kept in this node's cache",
            index_command(given),
        )
        return
    kept = (
        "the summary rewritten where the store allows it"
        if publish
        else "what they tell kept in this node's cache"
    )
    warnings.warn(
        f"the summary {where} is stale: {len(shards)} shard(s) changed since it was written: "
        f"{describe_stale(shards)}; their indexes are read (or made) instead and {kept} "
        f"({index_command(given)} rewrites the summary beside the shards)",
        stacklevel=3,
    )


def _opened(
    urls: list[str], storage: Storage, counts: _Int64s, hashes: list[str], listed: Listed
) -> TarShards:
    starts = np.zeros(len(urls) + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    return TarShards(
        urls,
        storage,
        counts,
        starts,
        hashes,
        listed.identities,
        listed.listed_idx,
        vouched=list(listed.vouched) or [None] * len(urls),
    )


def shard_entries(
    storage: Storage,
    urls: Sequence[str],
    counts: _Int64s,
    hashes: Sequence[str],
    identities: Sequence[Identity],
    indexes: Sequence[str] = (),
) -> dict[str, dict[str, ShardEntry]]:
    """Summary entries of ``urls``, by directory (``indexes``: the ``.idx`` text each keeps)."""
    by_directory: dict[str, dict[str, ShardEntry]] = {}
    for k, url in enumerate(urls):
        size, version = identities[k]
        idx = indexes[k] if indexes else ""
        entry = ShardEntry(size, version, int(counts[k]), hashes[k], idx)
        by_directory.setdefault(storage.dirname(url), {})[storage.basename(url)] = entry
    return by_directory


def _write_summaries(
    storage: Storage,
    urls: list[str],
    counts: _Int64s,
    hashes: list[str],
    listed: Listed,
    summaries: dict[str, tuple[dict[str, ShardEntry], str] | None],
    kept: list[int],
    beside: bool,
) -> None:
    """Write the summary of each directory in this node's cache (``beside``: beside the shards,
    where the store allows it): the entries of shards ``kept`` over those the old summary has of
    other shards still as listed."""
    identities = [listed.identities[k] for k in kept]
    for directory, entries in shard_entries(
        storage, [urls[k] for k in kept], counts[kept], [hashes[k] for k in kept], identities
    ).items():
        summary = summaries[directory]
        merged = updated({} if summary is None else summary[0], entries, listed.listings[directory])
        try:
            where = write_summary(storage, directory, merged, beside=beside)
        except OSError as error:
            logger.info("cannot keep a summary of %s anywhere (%s)", directory, error)
            continue
        logger.info("wrote the summary %s (%d shards)", where, len(merged))
