"""The summary of a directory of tar shards: one small object beside them. Runs in the worker and
in ``python -m loader.tars``.

``loader-summary.json`` beside the shards lists, for each shard it covers, what a worker needs to
plan an epoch without opening the shard or its index: the shard's identity when it was indexed
(its size, and its ETag or mtime) and its index's sample count and keys' hash. The workers of a
node read it with one request; where it names every remote shard a job asks for, it stands for
the directory's listing (each shard's identity then checked by the read of its bytes), else
every entry is checked against the listing; a worker fetches a shard's ``.idx`` only when it is
about to read that shard (:mod:`sources.tars._shards`)::

    {"format": "dali-capture-loader tar summary", "version": 1,
     "columns": ["name", "size", "version", "samples", "keys"],
     "shards": [["train-000000.tar", 1843200, "ETag:9b2c...", 1251, "3f9a0c5e7d21b844"], ...],
     "samples": 1281167,
     "indexes": {"train-000007.tar": "v1.2 4\\ncls 512 1 s0.cls ...", ...}}

``indexes`` (optional) holds the ``.idx`` text of the shards whose index is small (at most
:data:`INLINE_IDX` bytes: about a dozen samples): the index command keeps it there instead of
writing an ``.idx`` beside each (one request a shard fewer to index a dataset of many small
shards, and to read one), unless asked for the files (``--idx-files``: DALI's own
``readers.webdataset`` reads ``.idx`` files). A loader that does not know the key ignores it
(and reads or makes the shard's index as before).

An entry whose shard's size or version differs from the listing is *stale*: it is not used (the
shard's index is read or made instead) and the shards that differ are named. Entries of shards a
job does not ask for are kept untouched, so one summary serves ``train-*`` and ``val-*`` in one
directory. A job keeps the summary it makes in this node's cache (named by a hash of the
directory's URL and endpoint), checked the same way, and read after the one beside the shards;
only the index command (or a job asked to publish: ``publish_index=True``) writes it beside
them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ..storage import Identity, Storage, cached_path, open_document, write_document

logger = logging.getLogger("workers")

SUMMARY = "loader-summary.json"
FORMAT = "dali-capture-loader tar summary"
VERSION = 1
_COLUMNS = ["name", "size", "version", "samples", "keys"]
#: The largest ``.idx`` text the index command keeps in the summary instead of beside its shard.
INLINE_IDX = 1024


@dataclass(frozen=True)
class ShardEntry:
    """One shard in a summary: its identity when indexed, its samples and its keys' hash, and
    its ``.idx`` text where the summary keeps it ("": beside the shard, or nowhere)."""

    size: int
    version: str
    samples: int
    keys: str
    idx: str = ""

    @property
    def identity(self) -> Identity:
        return (self.size, self.version)


def encode(entries: Mapping[str, ShardEntry]) -> bytes:
    """The summary's bytes (shards sorted by name)."""
    rows = [
        [name, entry.size, entry.version, entry.samples, entry.keys]
        for name, entry in sorted(entries.items())
    ]
    document = {
        "format": FORMAT,
        "version": VERSION,
        "columns": _COLUMNS,
        "shards": rows,
        "samples": sum(entry.samples for entry in entries.values()),
    }
    indexes = {name: entry.idx for name, entry in sorted(entries.items()) if entry.idx}
    if indexes:
        document["indexes"] = indexes
    return (json.dumps(document, separators=(",", ":")) + "\n").encode()


def decode(data: bytes, where: str) -> dict[str, ShardEntry]:
    """The entries of a summary; ``ValueError`` naming ``where`` when it is not one."""
    document = open_document(data, where, FORMAT, VERSION, _COLUMNS, "python -m loader.tars index")
    entries = {}
    indexes = document.get("indexes") or {}
    try:
        if not isinstance(indexes, dict) or not all(isinstance(v, str) for v in indexes.values()):
            raise TypeError("its indexes are not a map of shard name -> .idx text")
        for name, size, version, samples, keys in document["shards"]:
            idx = indexes.get(name, "")
            entries[str(name)] = ShardEntry(int(size), str(version), int(samples), str(keys), idx)
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{where} has a malformed shard entry ({error})") from None
    return entries


def summary_url(directory: str) -> str:
    return Storage.join(directory, SUMMARY)


def cached_summary_path(storage: Storage, directory: str) -> Path:
    """This node's copy of a directory's summary (what a job learns, kept off the data)."""
    return cached_path(storage, directory, "tar-index", ".summary.json")


def read_summary(
    storage: Storage,
    directory: str,
    listing: Mapping[str, Identity] | None,
    read: Callable[[str], bytes] | None = None,
) -> tuple[dict[str, ShardEntry], str] | None:
    """The summary of ``directory`` and where it was read: the store's (when the listing shows
    one, or there is no listing: no request otherwise), else this node's copy; None when there
    is none or it cannot be read (logged). ``read``: how the store's is read (its bytes, or
    ``FileNotFoundError``; by default ``storage.read_all``)."""
    found: list[tuple[dict[str, ShardEntry], str]] = []
    url = summary_url(directory)
    if listing is None or SUMMARY in listing:
        try:
            found.append((decode((read or storage.read_all)(url), url), url))
        except FileNotFoundError:
            pass
        except ConnectionError:  # (the store cannot be reached: nothing else will)
            raise
        except (OSError, ValueError) as error:
            logger.warning("ignored the summary %s (%s)", url, error)
    cached = cached_summary_path(storage, directory)
    if cached.exists():
        try:
            found.append((decode(cached.read_bytes(), str(cached)), str(cached)))
        except (OSError, ValueError) as error:
            logger.warning("ignored the summary %s (%s)", cached, error)
    if not found:
        return None
    if len(found) == 1:
        return found[0]
    entries = dict(found[1][0])  # the node's copy, then the store's on top
    entries.update(found[0][0])
    return entries, found[0][1]


def updated(
    old: Mapping[str, ShardEntry],
    new: Mapping[str, ShardEntry],
    listing: Mapping[str, Identity] | None,
) -> dict[str, ShardEntry]:
    """``new`` over ``old``, keeping the entries of ``old`` whose shard is still listed as it
    was (those of other shard sets in the directory)."""
    kept = {
        name: entry
        for name, entry in old.items()
        if listing is not None and listing.get(name) == entry.identity
    }
    kept.update(new)
    return kept


def write_summary(
    storage: Storage, directory: str, entries: Mapping[str, ShardEntry], *, beside: bool
) -> str:
    """Write the summary in this node's cache, or with ``beside`` (the index command, a job
    asked to publish) beside the shards, falling back to the cache where the store refuses it;
    returns where it went. Raises ``OSError`` when it cannot be written anywhere."""
    data = encode(entries)
    url = summary_url(directory) if beside else None
    return write_document(storage, url, cached_summary_path(storage, directory), data)


def describe_stale(stale: list[tuple[str, str]], limit: int = 5) -> str:
    """``train-000003.tar (size 1000 -> 1200), ...`` for a message."""
    shown = ", ".join(f"{name} ({why})" for name, why in stale[:limit])
    return shown + (f" and {len(stale) - limit} more" if len(stale) > limit else "")


def stale_reason(entry: ShardEntry, identity: Identity) -> str:
    if entry.size != identity[0]:
        return f"size {entry.size} -> {identity[0]}"
    return f"{entry.version or 'no version'} -> {identity[1] or 'no version'}"
