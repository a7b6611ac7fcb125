"""The index of a WebDataset tar shard: its samples and where their members lie. Runs in the worker.

A WebDataset tar holds samples as consecutive members named ``<key>.<ext>`` (``n01440764/x.jpg``,
``n01440764/x.cls``): the key is the member's path up to the first dot of its file name, the
extension everything after it. A :class:`TarIndex` lists, in tar order, each sample's key and, for
every member, its sample, extension, data offset and size: what DALI's ``wds2idx`` keeps
(:mod:`workers.sources.tars._wds_idx` reads and writes that format, the one kept beside the shards).

An index comes from one of three places (:mod:`workers.sources.tars._shards` decides which):

* :func:`scan`: one sequential pass over the tar (``tarfile`` in stream mode, so an object store
  is read once, front to back), which also checks that the shard is whole and well formed;
* a ``.idx`` file beside the shard (:func:`workers.sources.tars._wds_idx.parse_idx`);
* this node's cache (``$DALI_LOADER_CACHE_DIR/tar-index/``, :func:`load_cached`): a copy of an
  index in a form workers map, named by a hash of the shard's URL and endpoint (or real path:
  :meth:`Storage.cache_name`) and valid for one identity of the shard (its size, and ETag or
  mtime): a changed shard misses it. What a job makes goes there (a job writes nothing beside
  the data unless asked).

Bad shards raise before any batch: a file that is not a tar or ends inside a member (``ValueError``
with the URL and the offset), a member whose name has no extension, a key that appears twice
apart, two members of a sample with one extension, or a member that is not a regular file.
Under ``on_error="skip"`` such a shard gives its whole samples before the damage instead
(:func:`scan_whole_samples`).

An index made from the tar's own headers (a scan) is marked ``scanned``; one read from an ``.idx``
is not, and the tar loader checks each member's header against it as it reads the member's bytes
(:func:`workers.sources.tars._wds_idx.member_mismatch`).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from ..storage import Identity, Storage, cache_dir, read_index_file, write_index_file

logger = logging.getLogger("workers")

MAGIC = b"DLTARIX2"
FORMAT = 2

_Int64s = np.ndarray[Any, np.dtype[np.int64]]


@dataclass
class TarIndex:
    """The samples of one tar: keys in tar order, and every member's sample, extension, data
    offset and size (arrays, mapped from a cached index or made by a scan or a parse)."""

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
    #: what is wrong with the shard, when this indexes only its samples before the damage
    #: (:func:`scan_whole_samples`); such an index is kept in this node's cache only
    damage: str = ""
    #: with ``damage``: where what is left out starts (``sample 's4' at byte 8192``)
    left_from: str = ""
    #: made from the tar's own headers (a scan), not from an ``.idx``, whose entries the tar
    #: loader checks against each member's header as it reads the member
    scanned: bool = False

    @property
    def samples(self) -> int:
        return len(self.key_offsets) - 1

    @property
    def member_starts(self) -> _Int64s:
        """Where each sample's members start in the member arrays (they are consecutive, in
        tar order), and the end."""
        found: _Int64s = np.searchsorted(self.member_sample, np.arange(self.samples + 1))
        return found

    @property
    def data_end(self) -> int:
        """Where the last member's data ends (the tar's end-of-archive blocks come after it)."""
        if not len(self.member_offset):
            return 0
        return int((self.member_offset + self.member_size).max())

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


class IndexBuilder:
    """Collects a tar's members in tar order (from a scan, a ``.idx`` file or a writer) and
    checks them as WebDataset needs: a sample's members consecutive, one per extension.
    ``where`` names the source in errors (``<url>`` or ``<idx url> line 7``)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._keys: list[bytes] = []
        self._seen: dict[str, int] = {}
        self._exts: dict[str, int] = {}
        self._current: set[str] = set()
        self.member_sample: list[int] = []
        self.member_ext: list[int] = []
        self.member_offset: list[int] = []
        self.member_size: list[int] = []

    def add(self, name: str, offset: int, size: int, where: str, at: str) -> None:
        """Member ``name`` whose data lies at ``[offset, offset + size)``; ``at`` says where it
        was found (``at byte 1536``) for errors."""
        split = split_name(name)
        if split is None:
            raise ValueError(
                f"{where}: member {name!r} {at} has no extension; WebDataset members are named "
                "<key>.<ext> (e.g. n0144/img7.jpg)"
            )
        key, ext = split
        sample = self._seen.get(key)
        if sample is None:
            sample = self._seen[key] = len(self._keys)
            self._keys.append(key.encode("utf-8", "surrogateescape"))
            self._current = set()
        elif sample != len(self._keys) - 1:
            raise ValueError(
                f"{where}: key {key!r} appears again {at} after other keys; a sample's members "
                "must be consecutive in the tar"
            )
        if ext in self._current:
            raise ValueError(
                f"{where}: sample {key!r} has two members with extension {ext!r} ({at})"
            )
        self._current.add(ext)
        self.member_sample.append(sample)
        self.member_ext.append(self._exts.setdefault(ext, len(self._exts)))
        self.member_offset.append(offset)
        self.member_size.append(size)

    @property
    def samples(self) -> int:
        return len(self._keys)

    def build(self, *, empty: bool = False) -> TarIndex:
        """The index; ``ValueError`` when it holds no sample, unless ``empty``."""
        if not self._keys and not empty:
            raise ValueError(f"{self.url} holds no samples")
        keys = self._keys
        key_offsets = np.zeros(len(keys) + 1, dtype=np.int64)
        np.cumsum([len(key) for key in keys], out=key_offsets[1:])
        blob = np.frombuffer(b"".join(keys), dtype=np.uint8)
        ext_list = list(self._exts)
        ext_ids = np.asarray(self.member_ext, dtype=np.int64)
        counts = np.bincount(ext_ids, minlength=len(ext_list))
        return TarIndex(
            self.url,
            ext_list,
            key_offsets,
            blob,
            np.asarray(self.member_sample, dtype=np.int64),
            ext_ids,
            np.asarray(self.member_offset, dtype=np.int64),
            np.asarray(self.member_size, dtype=np.int64),
            {ext: int(count) for ext, count in zip(ext_list, counts.tolist(), strict=True)},
            keys_hash(key_offsets, blob),
        )


def keys_hash(key_offsets: _Int64s, keys: np.ndarray[Any, Any]) -> str:
    """A shard's keys, in order, as 16 hex digits (part of the dataset's fingerprint)."""
    offsets = np.ascontiguousarray(key_offsets, dtype="<i8")
    return hashlib.sha256(offsets.tobytes() + bytes(keys)).hexdigest()[:16]


def scan(url: str, stream: IO[bytes], *, seekable: bool, size: int | None = None) -> TarIndex:
    """Index the tar read from ``stream`` (named ``url`` in errors); ``ValueError`` naming it
    when it is not a whole WebDataset shard. ``size``: the shard's, when ``stream`` cannot
    seek (to check that it ends after its last member's data and the end-of-archive blocks)."""
    index, damage = scan_whole_samples(url, stream, seekable=seekable, size=size)
    if damage is not None:
        raise damage
    return index


_Member = tuple[str, int, int, str]  # name, data offset, size, where found ("at byte 1536")


def scan_whole_samples(
    url: str, stream: IO[bytes], *, seekable: bool, size: int | None = None
) -> tuple[TarIndex, ValueError | None]:
    """Index the tar read from ``stream``, and what is wrong with it (None: nothing). A shard
    that is not whole (truncated, corrupt, a member that breaks WebDataset's rules) gives the
    index of its whole samples before the damage (the sample the damage falls in left out: its
    other members may be gone; every sample before it kept), and the error :func:`scan`
    raises."""
    members, offset, damage = _members(url, stream, seekable=seekable, size=size)
    broken = (damage.name, damage.at) if isinstance(damage, _NotAFile) else None
    # the members before the damage: all of them, or those whose data ends before it
    stop = len(members) if damage is None else sum(1 for m in members if m[1] + m[2] <= offset)
    builder = IndexBuilder(url)
    for number, (name, data, length, at) in enumerate(members[:stop]):
        try:
            builder.add(name, data, length, url, at)
        except ValueError as error:  # (the first damage in tar order is the one named)
            damage, stop, broken = error, number, (name, at)
            break
    else:
        if damage is None:
            try:
                index = builder.build()
                index.scanned = True
                return index, None
            except ValueError as error:  # (no samples)
                damage = error
    index = _before(url, members, stop, broken)
    index.damage = str(damage)
    index.scanned = True
    return index, damage


def scan_bytes(url: str, data: bytes) -> tuple[TarIndex, ValueError | None]:
    """:func:`scan_whole_samples` of a shard held whole in memory (read with one GET): its
    headers read straight when they are all plain ones (:func:`_plain_members`), else, and for
    every error's words, by ``tarfile``."""
    plain = _plain_members(data)
    if plain is not None:
        with contextlib.suppress(ValueError):  # (the slow path words the error)
            builder = IndexBuilder(url)
            for name, offset, length, at in plain:
                builder.add(name, offset, length, url, at)
            index = builder.build()
            index.scanned = True
            return index, None
    return scan_whole_samples(url, io.BytesIO(data), seekable=True)


_BLOCK = 512
_ZERO_BLOCK = bytes(_BLOCK)
_OCTAL = frozenset(b"01234567")


def _plain_members(data: bytes) -> list[_Member] | None:
    """The members of a whole tar in ``data`` read straight from its headers, when every
    header is a plain one (ustar or GNU, a regular file or a directory, an octal size, its
    checksum right) and the last member is followed by the two zero blocks that end an archive:
    what :func:`_members` gives for it, without ``tarfile``'s cost per header. None for anything
    else (long names, pax headers, links, damage): :func:`_members` reads those."""
    members: list[_Member] = []
    offset, end = 0, len(data)
    while True:
        header = data[offset : offset + _BLOCK]
        if len(header) < _BLOCK:
            return None  # (no end-of-archive blocks)
        if header == _ZERO_BLOCK:  # the end of the archive: a second zero block must follow
            whole = data[offset + _BLOCK : offset + 2 * _BLOCK] == _ZERO_BLOCK
            return members if whole else None
        kind = header[156:157]
        checksum = header[148:156].rstrip(b"\0 ")
        size_field = header[124:136].rstrip(b"\0 ").lstrip(b" ")
        if (
            kind not in (b"0", b"\0", b"5")
            or not checksum
            or not _OCTAL.issuperset(checksum)
            or not _OCTAL.issuperset(size_field)
            or int(checksum, 8) != sum(header) - sum(header[148:156]) + 8 * 32
        ):
            return None
        size = int(size_field or b"0", 8)
        name_bytes = header[:100].split(b"\0", 1)[0]
        prefix = header[345:500].split(b"\0", 1)[0]  # (joined as ``tarfile`` joins it)
        try:
            name = name_bytes.decode() if not prefix else f"{prefix.decode()}/{name_bytes.decode()}"
        except UnicodeDecodeError:
            return None
        start = offset + _BLOCK
        if start + size > end:
            return None  # (truncated)
        if kind == b"0" or (kind == b"\0" and not name.endswith("/")):
            members.append((name, start, size, f"at byte {offset}"))
        offset = start + -(-size // _BLOCK) * _BLOCK


class NotATar(ValueError):
    """A file given as a shard that is no tar at all (not a damaged one)."""


def _members(
    url: str, stream: IO[bytes], *, seekable: bool, size: int | None
) -> tuple[list[_Member], int, ValueError | None]:
    """The tar's file members, where the reading stopped (the last header's offset, or the
    end of the data when it ends too soon), and what is wrong with it (None: nothing)."""
    members: list[_Member] = []
    offset = tar_end = 0
    try:
        with tarfile.open(fileobj=stream, mode="r:" if seekable else "r|") as tar:
            for member in tar:
                offset = member.offset
                if member.isdir():
                    continue
                if not member.isfile():
                    raise _NotAFile(url, member.name, f"at byte {member.offset}")
                at = f"at byte {member.offset}"
                members.append((member.name, member.offset_data, member.size, at))
            tar_end = tar.offset  # where the next header (or the end-of-archive blocks) starts
    except tarfile.ReadError as error:
        if not members and offset == 0:  # (not even a first header: no tar at all)
            return (
                members,
                0,
                NotATar(
                    f"{url} is not a tar file ({error}){_compressed(url, stream, seekable)}: "
                    "take it out of the shards"
                ),
            )
        return (
            members,
            offset,
            ValueError(
                f"{url} is not a whole tar file (read up to byte {offset}: {error}); a truncated "
                "or corrupt shard must be rewritten"
            ),
        )
    except EOFError:
        return (
            members,
            offset,
            ValueError(f"{url} ends inside a member after byte {offset}: truncated"),
        )
    except ValueError as error:
        return members, offset, error
    if seekable or size is not None:  # every member whole, and the end-of-archive blocks after
        # the last one (a stream read them: it ended at a zero block)
        end = stream.seek(0, os.SEEK_END) if seekable else size
        assert end is not None
        last = max((o + s for _n, o, s, _a in members), default=0)
        if seekable:
            stream.seek(tar_end)
        if last > end or tar_end + 1024 > end or (seekable and stream.read(1024) != bytes(1024)):
            return (
                members,
                min(end, offset),
                ValueError(
                    f"{url} is not a whole tar file: it ends at byte {end}, inside a member or "
                    "without the end-of-archive blocks (truncated); rewrite the shard"
                ),
            )
    return members, offset, None


class _NotAFile(ValueError):
    """A member that is not a regular file (a link or device): the damage is that member, the
    first of its sample's it reaches (the samples before it are whole)."""

    def __init__(self, url: str, name: str, at: str) -> None:
        super().__init__(
            f"{url}: member {name!r} {at} is not a regular file (a link or device); a "
            "WebDataset shard holds files only"
        )
        self.name, self.at = name, at


def _before(
    url: str, members: list[_Member], stop: int, broken: tuple[str, str] | None
) -> TarIndex:
    """The index of the whole samples among ``members[:stop]``: those with no member at or
    after the damage (``members[stop:]``, and ``broken``: the (name, where) of a member that is
    not among ``members``, when the damage is that member); the first member left out is
    recorded in its ``left_from``."""
    cut = [name for name, _o, _s, _a in members[stop:]]
    if broken is not None:
        cut.append(broken[0])
    cut_keys = {split[0] for split in map(split_name, cut) if split is not None}
    builder = IndexBuilder(url)
    left: tuple[str, str] | None = None
    before: dict[str, str] = {}  # samples before the damage left out with it: key -> where
    for name, data, length, at in members[:stop]:
        split = split_name(name)
        if split is not None and split[0] in cut_keys:
            before.setdefault(split[0], at)
            continue
        try:
            builder.add(name, data, length, url, at)
        except ValueError:  # (cannot happen: ``members[:stop]`` keep WebDataset's rules)
            left = (name, at)
            break
    if left is None and stop < len(members):
        name, _data, _length, at = members[stop]
        left = (name, at)
    left = left or broken
    index = builder.build(empty=True)
    if left is not None:
        split = split_name(left[0])
        index.left_from = (
            f"sample {split[0]!r} {left[1]}" if split is not None else f"{left[0]!r} {left[1]}"
        )
    if before:  # (read around: their keys come again in the part left out)
        named = ", ".join(f"{key!r} {at}" for key, at in list(before.items())[:3])
        more = f" and {len(before) - 3} more" if len(before) > 3 else ""
        index.left_from += (
            f" (and, before it, sample(s) {named}{more}, whose key comes again there)"
        )
    return index


def cache_path(storage: Storage, url: str) -> Path:
    """Where this node keeps its copy of the index of ``url`` (read through ``storage``)."""
    name = storage.cache_name(url)
    digest = hashlib.sha256(name.encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return cache_dir("tar-index") / f"{digest}.index"


def lock_path(storage: Storage, url: str) -> Path:
    """The lock that makes one process of this node index ``url`` while the others wait or
    do other work (created with its directory)."""
    path = cache_path(storage, url).with_suffix(".lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def load_cached(storage: Storage, url: str, identity: Identity) -> TarIndex | None:
    """This node's copy of the index of ``url`` when it was made for this ``identity``."""
    path = cache_path(storage, url)
    try:
        found = read_index_file(path, MAGIC)
    except (ValueError, KeyError, TypeError) as error:
        logger.warning("ignored the cached tar index %s of %s (%s)", path, url, error)
        return None
    if found is None:
        return None
    header, arrays, mapped = found
    try:
        if header["format"] != FORMAT or header["identity"] != list(identity):
            logger.debug("the cached index %s is stale: %s changed since it was made", path, url)
            return None
        damage = str(header.get("damage", ""))
        if damage and "left_from" not in header:  # (an older loader's: one sample short)
            logger.debug("the cached index %s of a damaged shard is an old one: scanning it", path)
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
            damage=damage,
            left_from=str(header.get("left_from", "")),
            scanned=bool(header.get("scanned", False)),
        )
    except (KeyError, TypeError, ValueError) as error:
        logger.warning("ignored the cached tar index %s of %s (%s)", path, url, error)
        return None


def keep_cached(storage: Storage, index: TarIndex, identity: Identity) -> bool:
    """Keep a copy of ``index`` in this node's cache; False when the cache is not writable."""
    path = cache_path(storage, index.url)
    header = {
        "format": FORMAT,
        "url": index.url,
        "identity": list(identity),
        "exts": index.exts,
        "ext_counts": index.ext_counts,
        "keys_hash": index.keys_hash,
        "damage": index.damage,
        "left_from": index.left_from,
        "scanned": index.scanned,
    }
    arrays: list[np.ndarray[Any, Any]] = [
        index.key_offsets,
        index.keys,
        index.member_sample,
        index.member_ext,
        index.member_offset,
        index.member_size,
    ]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_index_file(path, MAGIC, header, arrays)
    except OSError as error:
        logger.debug("cannot keep the index of %s in %s (%s)", index.url, path.parent, error)
        return False
    return True


def _compressed(url: str, stream: Any, seekable: bool) -> str:
    """``"; it is gzip-compressed ..."`` where the shard is (by its first bytes, where the stream
    can go back to them, or by its name), else ``""``: shards are read uncompressed."""
    gzipped = url.endswith((".gz", ".tgz"))
    if not gzipped and seekable:
        try:
            stream.seek(0)
            gzipped = stream.read(2) == b"\x1f\x8b"
        except (OSError, ValueError):
            gzipped = False
    if not gzipped:
        return ""
    return (
        "; it is gzip-compressed, and shards are read uncompressed (their members are read "
        "by ranged reads): decompress it (gunzip) and list the .tar"
    )
