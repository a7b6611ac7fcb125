"""The index of a WebDataset tar shard: its samples and where their members lie. Runs in the worker.

A WebDataset tar holds samples as consecutive members named ``<key>.<ext>`` (``n01440764/x.jpg``,
``n01440764/x.cls``): the key is the member's path up to the first dot of its file name, the
extension everything after it. An index lists, in tar order, each sample's key and, for every
member, its sample, extension, data offset and size -- what DALI's ``wds2idx`` keeps, in a form
workers map. It is made with one sequential pass over the tar (``tarfile`` in stream mode, so an
object store is read once, front to back) and kept:

* next to a local tar, as ``<tar>.loader-index``, when its directory is writable; else, and for
  remote objects always, in the cache directory's ``tar-index/`` (``DALI_LOADER_CACHE_DIR``),
  named by a hash of the URL (or real path);
* with the object's identity (size, and ETag or inode and mtime): an index whose object changed is
  made again.

Many workers open the same shards at once. :func:`open_indexes` goes through them starting at a
different shard in each worker; a shard whose index is missing is indexed by the first worker to
take its lock, and a worker that finds the lock held goes on to the next shard and comes back
later, so the shards are indexed by all workers together, each once.

Bad shards raise before any batch: a missing shard (``FileNotFoundError`` naming it), a file that
is not a tar or ends inside a member (``ValueError`` with the URL and the offset), a member whose
name has no extension, a key that appears twice apart, or a member that is not a regular file.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tarfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from . import _index_file
from ._folder_index import CACHE_DIR_ENV, cache_dir
from ._storage import Storage, is_url, local_path

logger = logging.getLogger("workers")

MAGIC = b"DLTARIX1"
FORMAT = 1
SUFFIX = ".loader-index"

_Int64s = np.ndarray[Any, np.dtype[np.int64]]


@dataclass
class TarIndex:
    """The samples of one tar: keys in tar order, and every member's sample, extension, data
    offset and size (arrays, mapped from the index file or made by a scan)."""

    url: str
    exts: list[str]  # the extensions found, in order of first appearance
    key_offsets: _Int64s  # where each key starts in ``keys`` (and the end)
    keys: np.ndarray[Any, np.dtype[np.uint8]]
    member_sample: _Int64s
    member_ext: _Int64s  # into ``exts``
    member_offset: _Int64s
    member_size: _Int64s
    #: members per extension (how many samples have it)
    ext_counts: dict[str, int]
    keys_hash: str
    keep: object = None  # the mapping the arrays view

    @property
    def samples(self) -> int:
        return len(self.key_offsets) - 1

    def key(self, sample: int) -> str:
        start, end = self.key_offsets[sample : sample + 2].tolist()
        return bytes(self.keys[start:end]).decode("utf-8", "surrogateescape")

    def table(self, wanted: Sequence[Sequence[str]]) -> tuple[_Int64s, _Int64s]:
        """(offsets, sizes), shape (samples, len(wanted)): where each sample's member for each
        wanted extension (any of its alternatives) lies; -1 where the sample has none."""
        offsets = np.full((self.samples, len(wanted)), -1, dtype=np.int64)
        sizes = np.full((self.samples, len(wanted)), -1, dtype=np.int64)
        for column, alternatives in enumerate(wanted):
            for ext in reversed(alternatives):  # the first alternative wins: written last
                if ext not in self.exts:
                    continue
                chosen = self.member_ext == self.exts.index(ext)
                rows = self.member_sample[chosen]
                offsets[rows, column] = self.member_offset[chosen]
                sizes[rows, column] = self.member_size[chosen]
        return offsets, sizes


def split_name(name: str) -> tuple[str, str] | None:
    """(key, extension) of a member name, WebDataset's way; None when it has no extension."""
    directory, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    if not dot or not stem or not ext:
        return None
    return (f"{directory}/{stem}" if directory else stem), ext


def scan(url: str, stream: IO[bytes], *, seekable: bool) -> TarIndex:
    """Index the tar read from ``stream`` (named ``url`` in errors)."""
    keys: list[bytes] = []
    seen: dict[str, int] = {}
    exts: dict[str, int] = {}
    member_sample: list[int] = []
    member_ext: list[int] = []
    member_offset: list[int] = []
    member_size: list[int] = []
    current: set[str] = set()
    offset = tar_end = 0
    try:
        with tarfile.open(fileobj=stream, mode="r:" if seekable else "r|") as tar:
            for member in tar:
                offset = member.offset
                if member.isdir():
                    continue
                if not member.isfile():
                    raise ValueError(
                        f"{url}: member {member.name!r} at byte {member.offset} is not a "
                        "regular file (a link or device); a WebDataset shard holds files only"
                    )
                split = split_name(member.name)
                if split is None:
                    raise ValueError(
                        f"{url}: member {member.name!r} at byte {member.offset} has no "
                        "extension; WebDataset members are named <key>.<ext> "
                        "(e.g. n0144/img7.jpg)"
                    )
                key, ext = split
                sample = seen.get(key)
                if sample is None:
                    sample = seen[key] = len(keys)
                    keys.append(key.encode("utf-8", "surrogateescape"))
                    current = set()
                elif sample != len(keys) - 1:
                    raise ValueError(
                        f"{url}: key {key!r} appears again at byte {member.offset} after other "
                        "keys; a sample's members must be consecutive in the tar"
                    )
                if ext in current:
                    raise ValueError(
                        f"{url}: sample {key!r} has two members with extension {ext!r} "
                        f"(the second at byte {member.offset})"
                    )
                current.add(ext)
                member_sample.append(sample)
                member_ext.append(exts.setdefault(ext, len(exts)))
                member_offset.append(member.offset_data)
                member_size.append(member.size)
            tar_end = tar.offset  # where the next header (or the end-of-archive blocks) starts
    except tarfile.ReadError as error:
        raise ValueError(
            f"{url} is not a whole tar file (read up to byte {offset}: {error}); a truncated "
            "or corrupt shard must be rewritten"
        ) from error
    except EOFError as error:
        raise ValueError(f"{url} ends inside a member after byte {offset}: truncated") from error
    if seekable:  # every member whole, and the end-of-archive blocks after the last one
        end = stream.seek(0, os.SEEK_END)
        last = max((o + s for o, s in zip(member_offset, member_size, strict=True)), default=0)
        stream.seek(tar_end)
        if last > end or stream.read(1024) != bytes(1024):
            raise ValueError(
                f"{url} is not a whole tar file: it ends at byte {end}, inside a member or "
                "without the end-of-archive blocks (truncated); rewrite the shard"
            )
    if not keys:
        raise ValueError(f"{url} holds no samples")
    key_offsets = np.zeros(len(keys) + 1, dtype=np.int64)
    np.cumsum([len(key) for key in keys], out=key_offsets[1:])
    blob = np.frombuffer(b"".join(keys), dtype=np.uint8)
    ext_list = list(exts)
    ext_ids = np.asarray(member_ext, dtype=np.int64)
    counts = np.bincount(ext_ids, minlength=len(ext_list))
    return TarIndex(
        url,
        ext_list,
        key_offsets,
        blob,
        np.asarray(member_sample, dtype=np.int64),
        ext_ids,
        np.asarray(member_offset, dtype=np.int64),
        np.asarray(member_size, dtype=np.int64),
        {ext: int(count) for ext, count in zip(ext_list, counts.tolist(), strict=True)},
        hashlib.sha256(key_offsets.tobytes() + blob.tobytes()).hexdigest()[:16],
    )


def index_path(url: str, *, beside: bool) -> Path:
    """Where the index of ``url`` is kept: beside a local tar, or in the cache directory."""
    if beside:
        return Path(local_path(url) + SUFFIX)
    name = url if is_url(url) else os.path.realpath(local_path(url))
    digest = hashlib.sha256(name.encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return cache_dir().parent / "tar-index" / f"{digest}.index"


def _lock_path(path: Path) -> Path:
    """The lock of the index at ``path``: in the cache directory (no litter beside the data),
    beside the index when the cache cannot be written."""
    locks = cache_dir().parent / "tar-index"
    try:
        locks.mkdir(parents=True, exist_ok=True)
    except OSError:
        return path.with_name(path.name + ".lock")
    digest = hashlib.sha256(os.fsencode(os.path.abspath(path))).hexdigest()[:32]
    return locks / f"{digest}.lock"


def _header(index: TarIndex, identity: tuple[int, str]) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "url": index.url,
        "identity": list(identity),
        "exts": index.exts,
        "ext_counts": index.ext_counts,
        "keys_hash": index.keys_hash,
    }


def _load(path: Path, url: str, identity: tuple[int, str]) -> TarIndex | None:
    """The index at ``path`` if it is whole and its tar unchanged; else None."""
    try:
        found = _index_file.read(path, MAGIC)
    except (ValueError, KeyError, TypeError) as error:
        logger.warning("ignored the tar index %s (%s): indexing %s again", path, error, url)
        return None
    if found is None:
        return None
    header, arrays, mapped = found
    try:
        if header["format"] != FORMAT or header["identity"] != list(identity):
            logger.debug("the index %s is stale: %s changed since it was made", path, url)
            return None
        key_offsets, keys, sample, ext, offset, size = arrays
        return TarIndex(
            url,
            list(header["exts"]),
            key_offsets,
            keys,
            sample,
            ext,
            offset,
            size,
            {str(k): int(v) for k, v in header["ext_counts"].items()},
            str(header["keys_hash"]),
            keep=mapped,
        )
    except (KeyError, TypeError, ValueError) as error:
        logger.warning("ignored the tar index %s (%s): indexing %s again", path, error, url)
        return None


def _arrays(index: TarIndex) -> list[np.ndarray[Any, Any]]:
    return [
        index.key_offsets,
        index.keys,
        index.member_sample,
        index.member_ext,
        index.member_offset,
        index.member_size,
    ]


class Indexer:
    """Opens the indexes of a set of shards, making the missing ones (see the module docstring)."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._unwritable: set[str] = set()

    def paths(self, url: str) -> list[Path]:
        """Where the index of ``url`` may be: beside it (local tars), then the cache."""
        if self.storage.local:
            return [index_path(url, beside=True), index_path(url, beside=False)]
        return [index_path(url, beside=False)]

    def find(self, url: str, identity: tuple[int, str]) -> TarIndex | None:
        for path in self.paths(url):
            index = _load(path, url, identity)
            if index is not None:
                return index
        return None

    def make(self, url: str, identity: tuple[int, str], *, wait: bool) -> TarIndex | None:
        """Index ``url`` under its lock and keep the index where it can be written. With
        ``wait=False``, None when another process holds the lock (it is indexing the shard)."""
        for path in self.paths(url):
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                with _index_file.locked(_lock_path(path), wait=wait) as held:
                    if not held:
                        return None
                    index = _load(path, url, identity)  # (made while this process waited)
                    if index is None:
                        index = self._scan(url)
                        self._keep(path, index, identity)
                    return index
            except OSError as error:
                if path.parent.as_posix() not in self._unwritable:
                    self._unwritable.add(path.parent.as_posix())
                    logger.info("cannot keep a tar index in %s (%s)", path.parent, error)
        logger.warning(
            "no writable place for the index of %s: it is made again by every worker at every "
            "start; set %s to a writable directory",
            url,
            CACHE_DIR_ENV,
        )
        return self._scan(url)

    def _scan(self, url: str) -> TarIndex:
        started = time.monotonic()
        with self.storage.open(local_path(url)) as stream:
            index = scan(url, stream, seekable=self.storage.local)
        logger.info(
            "indexed %s: %d samples in %.2f s", url, index.samples, time.monotonic() - started
        )
        return index

    def _keep(self, path: Path, index: TarIndex, identity: tuple[int, str]) -> None:
        _index_file.write(path, MAGIC, _header(index, identity), _arrays(index))


def open_indexes(
    urls: Sequence[str],
    storage: Storage,
    start: int,
    opened: Callable[[int, TarIndex], None],
) -> None:
    """Open (or make) the index of every shard, calling ``opened(k, index)`` for each; the walk
    starts at shard ``start`` (each worker at its own) and defers shards another process is
    indexing until the others are done."""
    identities = storage.identities([local_path(url) for url in urls])
    indexer = Indexer(storage)
    count = len(urls)
    pending = [(start + k) % count for k in range(count)] if count else []
    while pending:
        deferred = []
        for k in pending:
            index = indexer.find(urls[k], identities[k])
            if index is None:
                index = indexer.make(urls[k], identities[k], wait=False)
            if index is None:
                deferred.append(k)
            else:
                opened(k, index)
        if len(deferred) == len(pending):  # nothing else to do: wait for the first one's lock
            k = deferred.pop(0)
            made = indexer.make(urls[k], identities[k], wait=True)
            assert made is not None
            opened(k, made)
        pending = deferred
