"""A set of tar shards opened for a job: their sample counts, from as few requests as the store
allows. Runs in the worker (and in ``python -m loader.tars index``).

Where a shard's facts come from, cheapest first:

1. the directory's summary (:mod:`sources.tars._summary`): one request for every shard it covers
   (once per node: :func:`node_summary`). Where it names every remote shard asked for, it is
   the directory's listing: no listing is made, and each shard's identity is checked when the
   shard is read, by that read (:func:`start_facts`, :meth:`TarShards.changed`); elsewhere
   each entry is checked against the directory's listing (one request per 1,000 objects on S3);
2. the shard's ``.idx`` beside it (DALI's ``wds2idx`` format, :mod:`sources.tars._wds_idx`), or this
   node's cached copy of its index: one small request, or none;
3. a scan of the shard (:func:`workers.sources.tars._index.scan`): the whole shard, read once.

Opening a job's shards (:func:`open_shards`) reads the summary (and the listing, where it is
needed), and only for the shards the summary does not cover (or covers stale) goes to 2 and 3;
a worker fetches a shard's index only when it is about to read that shard (:meth:`Indexer.get`,
from the tar loader). An index made by a scan is written beside its shard as ``.idx`` when the
store can be written (else kept in this node's cache only), so a dataset is scanned once in its
lifetime; the job's lead worker (shard 0) then writes the summary, so the next start costs one
request.

Many workers open the same shards at once. Each walks them from its own place (its shard's share
of the list), so the shards without an index are scanned by all workers together: on one node a
shard is taken by the first worker to hold its lock (the others go on and come back); across
nodes, a worker checks for an ``.idx`` written meanwhile before it scans.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import posixpath
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from ..plan import REPORT_PROGRESS, STARTED_TOGETHER, encode_parts
from ..storage import (
    RETRIES,
    Identity,
    Storage,
    StorageFailure,
    cache_dir,
    expand_urls,
    local_path,
    locked,
    storage_for,
)
from ._index import TarIndex, scan_bytes
from ._indexer import Indexer, Source, index_command
from ._summary import (
    ShardEntry,
    describe_stale,
    read_summary,
    stale_reason,
    summary_url,
    updated,
    write_summary,
)
from ._wds_idx import idx_url

logger = logging.getLogger("workers")

_Int64s = np.ndarray[Any, np.dtype[np.int64]]
_T = TypeVar("_T")
#: Seconds between two progress lines of the lead worker while shards are indexed.
PROGRESS_EVERY = 10.0
#: Seconds of indexing before the lead worker's first progress line (a WARNING).
PROGRESS_FIRST = 5.0
#: Seconds between two ``wire.Starting`` records a worker sends the trainer while it indexes
#: shards (the trainer's startup wait counts it as alive while they come).
TELL_EVERY = 1.0
#: Remote shards whose indexes a worker finds (or makes) at once when it opens a dataset.
WALK_THREADS = 16
#: Seconds a listing of a remote directory made by another process of this node is used for.
LISTING_FRESH = 30.0


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
            return StorageFailure(
                f"{told_by} is wrong about {url}: it lists {planned}, the shard holds {holds}, "
                f"and this job planned its epochs with it. {told_by} was written again from the "
                "shard's bytes (where the store allows it): restart the job (a state saved "
                "before may be refused over the shard)"
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


def check_urls(urls: str | Iterable[str]) -> list[str]:
    """Expand ``urls`` and refuse a set that mixes places or lists a shard twice."""
    expanded = expand_urls(urls)
    kinds = {"://" in url and not url.startswith("file://") for url in expanded}
    if len(kinds) > 1:
        raise ValueError("the shards mix local paths and URLs; keep them in one place")
    protocols = {url.split("://", 1)[0] for url in expanded if "://" in url}
    if len(protocols) > 1:
        raise ValueError(f"the shards use several protocols ({sorted(protocols)}); use one")
    if len(set(expanded)) != len(expanded):
        raise ValueError("a shard is listed twice: every shard must appear once")
    return [local_path(url) for url in expanded]


@dataclass
class Listed:
    """What one listing per directory (or the directory's summary, in its place) tells of a set
    of shards."""

    listings: dict[str, dict[str, Identity] | None]
    identities: list[Identity]
    listed_idx: list[bool | None]
    #: per shard, the summary its identity comes from (not yet confirmed by the store: a read
    #: checks it), or None where a listing (or a HEAD) told it
    vouched: list[str | None] = field(default_factory=list)


Places = list[tuple[str, str]]


def places_of(storage: Storage, urls: Sequence[str]) -> Places:
    """(directory, name) of each of ``urls``, worked out once (at 10,000 shards, four lookups of
    each cost a worker's start 0.1 s); a URL split at its last ``/`` where that is what
    :meth:`Storage.dirname` and :meth:`Storage.basename` give."""
    if storage.local:
        return [(storage.dirname(url), storage.basename(url)) for url in urls]
    places = []
    for url in urls:
        directory, _, name = url.rpartition("/")
        if not directory or directory.endswith("/"):  # (no directory, or slashes doubled)
            directory, name = storage.dirname(url), storage.basename(url)
        places.append((directory, name))
    return places


def list_shards(storage: Storage, urls: Sequence[str]) -> Listed:
    """List each directory of ``urls`` once (remote ones once per node: :func:`node_listing`);
    ``FileNotFoundError`` naming a missing shard."""
    places = places_of(storage, urls)
    listings = {d: node_listing(storage, d) for d in dict.fromkeys(d for d, _ in places)}
    return _listed(storage, urls, places, listings, {})


def _listed(
    storage: Storage,
    urls: Sequence[str],
    places: Places,
    listings: dict[str, dict[str, Identity] | None],
    summaries: dict[str, str],
) -> Listed:
    """The shards' identities from ``listings`` (those of the directories in ``summaries``:
    the entries of the summary named there, which says nothing of ``.idx`` files)."""
    identities: list[Identity] = []
    listed_idx: list[bool | None] = []
    vouched: list[str | None] = []
    for url, (directory, name) in zip(urls, places, strict=True):
        listing = listings[directory]
        found = None if listing is None else listing.get(name)
        identities.append(found if found is not None else storage.identity(url))
        if listing is None or directory in summaries:
            listed_idx.append(None)
        else:
            listed_idx.append(idx_url(name) in listing)
        vouched.append(summaries.get(directory))
    return Listed(listings, identities, listed_idx, vouched)


def start_facts(
    storage: Storage, urls: Sequence[str], places: Places
) -> tuple[Listed, dict[str, tuple[dict[str, ShardEntry], str] | None]]:
    """The shards' identities and their directories' summaries, for a start. Local shards: a
    listing of each directory, then its summary. Remote ones: the summary first (one request
    per node: :func:`node_summary`); a directory whose summary names every one of its shards
    (with identities a read can check) is not listed: the summary is its listing, and each
    shard's identity is checked when it is read (:meth:`TarShards.index`,
    :meth:`Storage.read`). The others are listed (:func:`node_listing`). ``places``: the URLs'
    (:func:`places_of`)."""
    directories = dict.fromkeys(directory for directory, _ in places)
    if storage.local:
        listed = list_shards(storage, urls)
        found = {d: read_summary(storage, d, listed.listings[d]) for d in directories}
        return listed, found
    summaries = {d: node_summary(storage, d) for d in directories}
    covered: dict[str, str] = {d: s[1] for d, s in summaries.items() if s is not None}
    for directory, name in places:
        summary = summaries[directory]
        entry = None if summary is None else summary[0].get(name)
        if entry is None or not storage.can_check(entry.identity):
            covered.pop(directory, None)
    listings = {
        d: _as_listing(summaries[d]) if d in covered else node_listing(storage, d)
        for d in directories
    }
    return _listed(storage, urls, places, listings, covered), summaries


def _as_listing(
    summary: tuple[dict[str, ShardEntry], str] | None,
) -> dict[str, Identity]:
    assert summary is not None
    return {name: entry.identity for name, entry in summary[0].items()}


def node_listing(storage: Storage, directory: str) -> dict[str, Identity] | None:
    """The listing of ``directory``; of a remote one, shared by the workers started together (a
    loader's pool: :data:`workers.sources.plan.STARTED_TOGETHER`): the first to need it lists
    (under a lock) and keeps it in this node's cache, and the others read it while it is younger
    than :data:`LISTING_FRESH` seconds. A rank of W workers lists each directory once, not W
    times (a listing of 8,192 shards with their ``.idx`` files is 17 requests and 5 MB). Another
    start (a new pool, another rank, the index command) lists again: a shard changed since
    the last start is seen."""
    return _node_shared(
        storage,
        directory,
        "listing",
        lambda: storage.listing(directory),
        lambda listing: [[name, size, version] for name, (size, version) in listing.items()],
        lambda rows: {str(n): (int(size), str(version)) for n, size, version in rows},
    )


def node_summary(storage: Storage, directory: str) -> tuple[dict[str, ShardEntry], str] | None:
    """The summary of a remote ``directory`` (:func:`sources.tars._summary.read_summary`), its
    bytes read once by the workers started together, shared like :func:`node_listing`'s."""

    def stored() -> bytes | None:
        try:
            return storage.read_all(summary_url(directory))
        except FileNotFoundError:
            return None

    def read(url: str) -> bytes:
        data = _node_shared(
            storage,
            directory,
            "read-summary",
            stored,
            lambda data: data.decode("latin-1"),
            lambda text: str(text).encode("latin-1"),
            absent=True,
        )
        if data is None:
            raise FileNotFoundError(url)
        return data

    return read_summary(storage, directory, None, read)


def _node_shared(
    storage: Storage,
    directory: str,
    kind: str,
    make: Callable[[], _T | None],
    dump: Callable[[_T], Any],
    load: Callable[[Any], _T],
    *,
    absent: bool = False,
) -> _T | None:
    """``make()`` (a request about ``directory``), made once by the workers started together
    (see :func:`node_listing`) and kept in this node's cache as JSON (``dump``, ``load``);
    ``absent``: a None it gives is shared too (not made again)."""
    together = STARTED_TOGETHER.get()
    if storage.local or not together:
        return make()
    key = f"{together}\0{kind}\0{directory}".encode("utf-8", "surrogateescape")
    name = hashlib.sha256(key).hexdigest()[:32]
    path = cache_dir("tar-index") / f"{name}.{kind}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with locked(path.with_suffix(".lock")):
            found = _fresh(path, directory)
            if found is not None:
                return None if found[0] is None else load(found[0])
            made = make()
            if made is not None or absent:
                _keep(path, directory, None if made is None else dump(made))
            return made
    except OSError as error:  # no cache directory: each process makes its own
        logger.debug("cannot share the %s of %s (%s)", kind, directory, error)
        return make()


def _fresh(path: Path, directory: str) -> tuple[Any] | None:
    """``(value,)`` kept at ``path`` for ``directory``, while fresh; None otherwise."""
    try:
        document = json.loads(path.read_bytes())
        if document["directory"] != directory:
            return None
        if not 0 <= time.time() - float(document["listed_at"]) < LISTING_FRESH:
            return None
        return (document["value"],)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _keep(path: Path, directory: str, value: Any) -> None:
    document = {"directory": directory, "listed_at": time.time(), "value": value}
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(document, separators=(",", ":")))
    os.replace(temporary, path)
    # earlier starts' copies serve nobody any more
    for pattern in ("*.listing.json", "*.read-summary.json"):
        for old in path.parent.glob(pattern):
            with contextlib.suppress(OSError):
                if time.time() - old.stat().st_mtime > 2 * LISTING_FRESH:
                    old.unlink()
                    old.with_suffix(".lock").unlink()


def open_shards(
    urls: str | Iterable[str],
    storage_options: dict[str, Any] | None,
    start_fraction: float,
    retries: int = RETRIES,
    *,
    lead: bool = False,
    skip_damaged: bool = False,
) -> TarShards:
    """Expand, check and open the shards (see the module docstring). Shards the summary does not
    cover are indexed walking from ``start_fraction`` of them. The ``lead`` worker (one per job)
    names a stale summary, reports progress and writes the summary when it had to look past it.
    ``skip_damaged`` (``on_error="skip"``): a shard that is not whole gives its samples before
    the damage (the ``lead`` worker warns, naming it) instead of failing the start."""
    expanded = check_urls(urls)
    storage = storage_for(expanded[0], storage_options, retries)
    places = places_of(storage, expanded)
    listed, summaries = start_facts(storage, expanded, places)
    count = len(expanded)
    counts = np.zeros(count, dtype=np.int64)
    hashes = [""] * count
    planned: list[str | None] = [None] * count
    rest: list[int] = []
    stale: dict[str, list[tuple[int, ShardEntry]]] = {}
    for k, (directory, name) in enumerate(places):
        summary = summaries[directory]
        entry = None if summary is None else summary[0].get(name)
        if entry is not None and summary is not None and entry.identity == listed.identities[k]:
            counts[k], hashes[k], planned[k] = entry.samples, entry.keys, summary[1]
            continue
        if entry is not None and summary is not None:
            stale.setdefault(summary[1], []).append((k, entry))
        rest.append(k)
    if lead:
        for where, entries in stale.items():
            _report_stale(where, entries, expanded, listed, storage, urls)
    if not rest:
        shards = _opened(expanded, storage, counts, hashes, listed)
        shards.planned_from = planned
        return shards
    indexer = Indexer(storage, skip_damaged=skip_damaged)

    def opened(k: int, index: TarIndex) -> None:
        counts[k], hashes[k] = index.samples, index.keys_hash

    started = time.monotonic()
    unindexed = sum(1 for k in rest if listed.listed_idx[k] is False)
    progress = _WalkProgress(len(rest), unindexed, indexer, lead, index_command(urls))
    _walk(expanded, listed, indexer, rest, int(start_fraction * len(rest)), opened, progress)
    shards = _after_walk(
        urls, expanded, storage, counts, hashes, listed, summaries, rest, indexer, lead, started
    )
    shards.planned_from = planned
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
    what the walk cost and which shards are damaged, and writes the summary."""
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
        _write_summaries(storage, urls, counts, hashes, listed, summaries, kept)
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
            "Their .idx files are checked once and the summary rewritten",
            where,
            describe_stale(shards, 1),
        )
        return
    warnings.warn(
        f"the summary {where} is stale: {len(shards)} shard(s) changed since it was written: "
        f"{describe_stale(shards)}; their indexes are read (or made) instead and the summary "
        f"rewritten where the store allows it ({index_command(given)} does it at once)",
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
) -> dict[str, dict[str, ShardEntry]]:
    """Summary entries of ``urls``, by directory."""
    by_directory: dict[str, dict[str, ShardEntry]] = {}
    for k, url in enumerate(urls):
        size, version = identities[k]
        entry = ShardEntry(size, version, int(counts[k]), hashes[k])
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
) -> None:
    """Write the summary of each directory: the entries of shards ``kept`` over those the old
    summary has of other shards still as listed."""
    identities = [listed.identities[k] for k in kept]
    for directory, entries in shard_entries(
        storage, [urls[k] for k in kept], counts[kept], [hashes[k] for k in kept], identities
    ).items():
        summary = summaries[directory]
        merged = updated({} if summary is None else summary[0], entries, listed.listings[directory])
        try:
            where = write_summary(storage, directory, merged)
        except OSError as error:
            logger.info("cannot keep a summary of %s anywhere (%s)", directory, error)
            continue
        logger.info("wrote the summary %s (%d shards)", where, len(merged))


class _WalkProgress:
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


def _walk(
    urls: Sequence[str],
    listed: Listed,
    indexer: Indexer,
    shards: list[int],
    start: int,
    opened: Callable[[int, TarIndex], None],
    progress: _WalkProgress,
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
    progress: _WalkProgress,
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
