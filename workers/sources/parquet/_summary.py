"""The summary of a directory of Parquet files: one small object beside them, written by the index
command (``python -m loader index``, the one that indexes tars). Runs in the worker and in the
index command.

``loader-parquet-summary.json`` beside the files lists, for each file it covers, what a worker
needs to plan an epoch without reading the file's footer: its identity when it was indexed (its
size, and its ETag or mtime), its rows, its row groups (each one's rows and the byte range of
every column chunk, in the order of the schema's leaves) and its footer itself (what pyarrow
decodes a row group with); and, for the first file, its Arrow schema and its ``huggingface``
metadata (the features), for a reader to see.

Every file of a dataset repeats the same key-value metadata in its footer (``datasets`` writes its
features, and pyarrow the Arrow schema again with them: 10-40 KB a file, the class names of a
``ClassLabel`` twice). The summary keeps those values once, as ``shared`` (the first file's
values of 256 bytes or more), and each footer without them: ``[its bytes without them
(zlib, base64), [[offset, index in shared], ...]]``, from which the footer is rebuilt byte for
byte. 2,000 files written like ``datasets``' make a 0.7 MB summary instead of 8.6 MB (version 1,
each footer whole, is still read)::

    {"format": "dali-capture-loader parquet summary", "version": 2,
     "columns": ["name", "size", "version", "rows", "row_groups", "footer"],
     "leaves": ["image.bytes", "image.path", "label"],
     "schema": "image: struct<bytes: binary, path: string> ...", "huggingface": {...},
     "files": [["train-00000.parquet", 48213311, "ETag:9b2c...", 4357,
                [[100, [[4, 1093722], [1093722, 1093901], [1093901, 1094312]]], ...],
                ["eJzt...", [[1822, 0], [9644, 1]]]], ...],
     "shared": ["eJzt...", "eJzt..."], "rows": 1281167}

A job's start reads it once per node (one request) in place of the directory's listing and of
every footer: a start then costs a constant number of requests whatever the number of files.
Each file's identity is checked when its bytes are read (on S3 by the GET itself): a file that
changed since it was indexed is named, with the command that mends the summary. An entry whose
row groups disagree with its own footer (the summary was edited) is refused at the start, named
with the same command. Entries of files a job does not ask for are kept by the command, so one
summary serves ``train-*`` and ``validation-*`` in one directory.
"""

from __future__ import annotations

import base64
import datetime
import json
import logging
import os
import posixpath
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..storage import Identity, Storage, cached_path, open_document, write_document
from ._footers import parse_footer

__all__ = [
    "SUMMARY",
    "FileEntry",
    "decode",
    "encode",
    "entry_of",
    "index_command",
    "read_summary",
    "restore",
    "shared_values",
    "strip",
    "write_summary",
]

logger = logging.getLogger("workers")

SUMMARY = "loader-parquet-summary.json"
FORMAT = "dali-capture-loader parquet summary"
VERSION = 2
#: Earlier versions still read: 1, each footer whole.
OLDER = (1,)
_COLUMNS = ["name", "size", "version", "rows", "row_groups", "footer"]
#: Metadata values of at least this many bytes are kept once for all the files.
_SHARED_FROM = 256


def index_command(urls: str | Iterable[str], *, force: bool = False) -> str:
    """The command that writes (or mends) the summary of these files."""
    shown = urls if isinstance(urls, str) else " ".join(list(urls)[:3]) + " ..."
    return f"python -m loader index '{shown}'" + (" --force" if force else "")


@dataclass(frozen=True, eq=False)
class FileEntry:
    """One file in a summary: its identity when indexed, rows, row groups and footer bytes
    (:attr:`footer`). ``kept`` is the footer itself, or, with ``shared`` (a summary's values
    kept once), its bytes without them, zlib-compressed, ``cuts`` saying where they go
    (:func:`strip`): a summary's entries stay that small until a footer is asked for."""

    size: int
    version: str
    rows: int
    #: per row group: its rows and each column chunk's [start, end)
    groups: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]
    kept: bytes
    cuts: tuple[tuple[int, int], ...] = ()
    shared: tuple[bytes, ...] | None = None

    @property
    def identity(self) -> Identity:
        return (self.size, self.version)

    @property
    def footer(self) -> bytes:
        """The file's footer, its bytes as read."""
        if self.shared is None:
            return self.kept
        return restore(zlib.decompress(self.kept), self.cuts, list(self.shared))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FileEntry):
            return NotImplemented
        mine = (self.size, self.version, self.rows, self.groups, self.footer)
        return mine == (other.size, other.version, other.rows, other.groups, other.footer)

    __hash__ = None  # type: ignore[assignment]


def chunk_range(column: Any) -> tuple[int, int]:
    """[start, end) of one column chunk's pages in its file."""
    start = column.data_page_offset
    dictionary = column.dictionary_page_offset
    if column.has_dictionary_page and dictionary is not None and 0 < dictionary < start:
        start = dictionary
    return int(start), int(start + column.total_compressed_size)


def groups_of(footer: Any) -> tuple[tuple[int, tuple[tuple[int, int], ...]], ...]:
    """Each row group's rows and column chunks' byte ranges, from a parsed footer."""
    found = []
    for group in range(footer.num_row_groups):
        meta = footer.row_group(group)
        chunks = tuple(chunk_range(meta.column(k)) for k in range(meta.num_columns))
        found.append((int(meta.num_rows), chunks))
    return tuple(found)


def entry_of(identity: Identity, footer_bytes: bytes, footer: Any) -> FileEntry:
    """The entry of a file whose footer (its bytes and parsed) was just read."""
    return FileEntry(
        identity[0], identity[1], int(footer.num_rows), groups_of(footer), footer_bytes
    )


def described(footer: Any) -> tuple[list[str], str, Any]:
    """The leaves' paths, the Arrow schema as text, and the ``huggingface`` metadata (parsed) of
    a parsed footer."""
    leaves = [footer.schema.column(k).path for k in range(footer.num_columns)]
    schema = footer.schema.to_arrow_schema()
    metadata = schema.metadata or {}
    huggingface = None
    if b"huggingface" in metadata:
        try:
            huggingface = json.loads(metadata[b"huggingface"])
        except (UnicodeDecodeError, json.JSONDecodeError):
            huggingface = None
    return leaves, schema.remove_metadata().to_string(show_field_metadata=False), huggingface


def encode(entries: Mapping[str, FileEntry], first: Any | None = None) -> bytes:
    """The summary's bytes (files sorted by name); ``first``: a parsed footer whose schema and
    metadata describe the files."""
    ordered = sorted(entries.items())
    shared = shared_values(ordered[0][1].footer) if ordered else []
    rows = []
    for name, entry in ordered:
        stripped, cuts = strip(entry.footer, shared)
        groups = [[rows, [list(chunk) for chunk in chunks]] for rows, chunks in entry.groups]
        footer = [_text(zlib.compress(stripped, 6)), cuts]
        rows.append([name, entry.size, entry.version, entry.rows, groups, footer])
    document: dict[str, Any] = {"format": FORMAT, "version": VERSION, "columns": _COLUMNS}
    document["shared"] = [_text(zlib.compress(value, 6)) for value in shared]
    if first is not None:
        leaves, schema, huggingface = described(first)
        document.update(leaves=leaves, schema=schema, huggingface=huggingface)
    document["files"] = rows
    document["rows"] = sum(entry.rows for entry in entries.values())
    return (json.dumps(document, separators=(",", ":")) + "\n").encode()


def _text(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def shared_values(footer: bytes) -> list[bytes]:
    """The long values of a footer's key-value metadata (the ``huggingface`` features,
    pyarrow's ``ARROW:schema``): every file of a dataset repeats them, so the summary keeps
    them once."""
    try:
        metadata = parse_footer("the first file", footer).metadata or {}
    except ValueError:
        return []
    return sorted({v for v in metadata.values() if len(v) >= _SHARED_FROM}, key=len, reverse=True)


def strip(footer: bytes, shared: list[bytes]) -> tuple[bytes, list[list[int]]]:
    """``footer`` without the occurrences of ``shared`` values (their bytes are written in the
    Thrift as they are), and where each went: ``[offset in the footer, index in shared]``,
    in order."""
    cuts: list[tuple[int, int]] = []
    for index, value in enumerate(shared):
        at = footer.find(value)
        while at >= 0:
            if not any(s < at + len(value) and at < s + len(shared[k]) for s, k in cuts):
                cuts.append((at, index))
            at = footer.find(value, at + len(value))
    cuts.sort()
    parts, last = [], 0
    for at, index in cuts:
        parts.append(footer[last:at])
        last = at + len(shared[index])
    parts.append(footer[last:])
    return b"".join(parts), [[at, index] for at, index in cuts]


def restore(stripped: bytes, cuts: Iterable[Any], shared: list[bytes]) -> bytes:
    """The footer :func:`strip` gave ``stripped`` and ``cuts`` for."""
    parts, taken, position = [], 0, 0
    for at, index in cuts:
        value = shared[int(index)]
        literal = int(at) - position
        if literal < 0:
            raise ValueError("its shared values overlap")
        parts.append(stripped[taken : taken + literal])
        parts.append(value)
        taken += literal
        position = int(at) + len(value)
    parts.append(stripped[taken:])
    return b"".join(parts)


def _kept_of(
    stored: Any, shared: tuple[bytes, ...], version: int
) -> tuple[bytes, tuple[tuple[int, int], ...], tuple[bytes, ...] | None]:
    """A file's footer as its entry keeps it (:class:`FileEntry`'s ``kept``, ``cuts`` and
    ``shared``), checked to decompress (version 1: zlib and base64 of it all)."""
    if version == 1:
        return zlib.decompress(base64.b64decode(stored)), (), None
    data, cuts = stored
    packed = base64.b64decode(data)
    zlib.decompress(packed)  # (a cut or damaged one: named now, with the summary)
    return packed, tuple((int(at), int(index)) for at, index in cuts), shared


def decode(data: bytes, where: str) -> dict[str, FileEntry]:
    """The entries of a summary; ``ValueError`` naming ``where`` when it is not one."""
    document = open_document(
        data, where, FORMAT, VERSION, _COLUMNS, "python -m loader index", OLDER
    )
    entries = {}
    try:
        shared = tuple(zlib.decompress(base64.b64decode(v)) for v in document.get("shared", ()))
        for name, size, version, rows, groups, footer in document["files"]:
            entries[str(name)] = FileEntry(
                int(size),
                str(version),
                int(rows),
                tuple(
                    (int(count), tuple((int(s), int(e)) for s, e in chunks))
                    for count, chunks in groups
                ),
                *_kept_of(footer, shared, document["version"]),
            )
    except (KeyError, TypeError, ValueError, zlib.error) as error:
        raise ValueError(f"{where} has a malformed file entry ({error})") from None
    return entries


def summary_url(storage: Storage, directory: str) -> str:
    return storage.join(directory, SUMMARY)


def cached_summary_path(storage: Storage, directory: str) -> Path:
    """This node's copy of a directory's summary (where the index command could not write it
    beside the files: a read-only store)."""
    return cached_path(storage, directory, "parquet-summary", ".json")


def read_summary(
    storage: Storage, directory: str, stored: bytes | None
) -> tuple[dict[str, FileEntry], str] | None:
    """The summary of ``directory`` (``stored``: the bytes of the one beside the files, None
    when there is none) and where it was read; else this node's copy; None when there is none
    or it cannot be read (logged)."""
    url = summary_url(storage, directory)
    if stored is not None:
        try:
            return decode(stored, url), url
        except ValueError as error:
            logger.warning("ignored the summary %s (%s)", url, error)
    cached = cached_summary_path(storage, directory)
    if cached.exists():
        try:
            return decode(cached.read_bytes(), str(cached)), str(cached)
        except (OSError, ValueError) as error:
            logger.warning("ignored the summary %s (%s)", cached, error)
    return None


def write_summary(
    storage: Storage, directory: str, entries: Mapping[str, FileEntry], first: Any | None
) -> str:
    """Write the summary beside the files, else (the store refuses it) in this node's cache;
    returns where it went. Raises ``OSError`` when it cannot be written anywhere."""
    data = encode(entries, first)
    return write_document(
        storage, summary_url(storage, directory), cached_summary_path(storage, directory), data
    )


def shown_urls(given: Any) -> str | list[str]:
    return os.fspath(given) if isinstance(given, (str, os.PathLike)) else [str(u) for u in given]


def _version_shown(version: str | None) -> str:
    """A file's version as a person reads it: a local file's mtime as a time, not nanoseconds
    (``mtime:1796672396140416171`` -> ``modified 2026-12-07 19:39:56.140``)."""
    if not version:
        return "no version"
    if version.startswith("mtime:") and version[len("mtime:") :].isdigit():
        when = datetime.datetime.fromtimestamp(int(version[len("mtime:") :]) / 1e9)
        return f"modified {when:%Y-%m-%d %H:%M:%S.%f}"[:-3]
    return version


def warn_stale(
    stale: list[tuple[str, FileEntry, Identity]], entries: Sequence[Any], given: Any
) -> None:
    """Name the files a summary is stale for (their footers are read instead)."""
    import warnings

    shown = ", ".join(
        f"{posixpath.basename(url)} (size {entry.size} -> {identity[0]})"
        if entry.size != identity[0]
        else f"{posixpath.basename(url)} ({_version_shown(entry.version)} -> "
        f"{_version_shown(identity[1])})"
        for url, entry, identity in stale[:5]
    ) + (f" and {len(stale) - 5} more" if len(stale) > 5 else "")
    where = next(entry[1] for entry in entries if entry is not None)
    warnings.warn(
        f"the summary {where} is stale: {len(stale)} file(s) changed since it was written: "
        f"{shown}; their footers are read instead ({index_command(shown_urls(given))} rewrites "
        "the summary)",
        stacklevel=3,
    )
