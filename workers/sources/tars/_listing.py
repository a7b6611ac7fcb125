"""What one listing per directory (or the directory's summary, in its place) tells of a job's
tar shards: their identities and whether an ``.idx`` lies beside each, from as few requests as
the store allows; a remote directory's listing and summary read once by the workers started
together and shared through this node's cache. Runs in the worker (and in ``python -m
loader.tars index``).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ..plan import STARTED_TOGETHER
from ..storage import RETRIES, Identity, Storage, cache_dir, local_path, locked
from ._names import shard_names
from ._summary import ShardEntry, read_summary, summary_url
from ._wds_idx import idx_url

logger = logging.getLogger("workers")

_T = TypeVar("_T")
#: Seconds a listing of a remote directory made by another process of this node is used for.
LISTING_FRESH = 30.0


def check_urls(
    urls: str | os.PathLike[str] | Iterable[str],
    storage_options: dict[str, Any] | None = None,
    retries: int = RETRIES,
) -> list[str]:
    """Expand ``urls`` (:func:`~._names.shard_names`: directories, globs, brace patterns) and
    refuse a set that mixes places or lists a shard twice."""
    expanded = shard_names(urls, storage_options, retries)
    kinds = {"://" in url and not url.startswith("file://") for url in expanded}
    if len(kinds) > 1:
        raise ValueError("the shards mix local paths and URLs; keep them in one place")
    protocols = {url.split("://", 1)[0] for url in expanded if "://" in url}
    if len(protocols) > 1:
        raise ValueError(f"the shards use several protocols ({sorted(protocols)}); use one")
    if len(set(expanded)) != len(expanded):
        twice = [url for url, count in collections.Counter(expanded).items() if count > 1]
        raise ValueError(
            f"a shard is listed twice ({', '.join(twice[:5])}): every shard must "
            "appear once (a pattern and a list, or two patterns, that overlap?)"
        )
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


def node_read(storage: Storage, url: str) -> bytes | None:
    """The bytes of the small object ``url`` (a summary), read once by the workers started
    together and shared like :func:`node_listing`'s; None when there is none."""

    def stored() -> bytes | None:
        try:
            return storage.read_all(url)
        except FileNotFoundError:
            return None

    return _node_shared(
        storage,
        url,
        "read-summary",
        stored,
        lambda data: data.decode("latin-1"),
        lambda text: str(text).encode("latin-1"),
        absent=True,
    )
