"""The plan of a Parquet dataset, from its files' footers alone. Runs in the worker.

:func:`open_plan` lists the files (paths, directories -- their ``*.parquet`` in name order --,
globs, brace patterns and fsspec URLs), takes each one's size and identity from the listing (no
HEAD), reads each footer with one ranged read of the file's tail (a second only when the footer
is longer than that read; a remote file's once per node: :mod:`._footers`), and checks that
every file has the requested columns, of one type across files, and of a kind the reader gives
(:mod:`._columns`).

What it makes, :class:`ParquetPlan`: the row groups of all the files, in file order, each with
its rows and the byte range of the requested columns' chunks (what one ranged read fetches).
Sample ids number the rows row group after row group. The row group is the unit the epoch's
order deals (``counts`` and ``starts``, as tar shards have); a layout's part edges cut a row
group into row ranges, so more workers than files all work.

A row group whose chunks lie outside its file (a truncated or rewritten file) is damaged: an
error naming the file, the row group and the byte range; under ``on_error="skip"`` it is left out
of every epoch and listed in ``stats().left_out``.

With the directory's summary (:mod:`._summary`, written by ``python -m loader index``), the
plan reads neither the listing of a remote directory nor any footer: one request (once per node)
for every file the summary covers, each file's identity then checked by the reads of its bytes.
A local file's identity is asked of the disk (free): an entry that no longer fits its file is
named and the file's footer read instead.

Nothing is written anywhere: reading a dataset never writes beside it.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from ..plan import SKIP_DAMAGED, OpenedOnce, encode_parts
from ..storage import (
    RETRIES,
    Identity,
    Storage,
    StorageFailure,
    storage_failure,
    storage_for,
)
from ..tars import node_listing, node_read
from ._arrow import pyarrow_modules
from ._columns import ColumnKind, column_kinds
from ._footers import node_footers_into, parse_footer, read_footer_bytes
from ._kept import KeptFooters
from ._listed import list_parquet
from ._schemas import agree, checked_schemas, leaf_columns
from ._summary import (
    FileEntry,
    chunk_range,
    groups_of,
    index_command,
    read_summary,
    shown_urls,
    summary_url,
    warn_stale,
)

__all__ = ["ParquetPlan", "checked_schemas", "list_parquet", "open_plan", "read_footer"]


class Listings:
    """Each remote directory listed once (by the workers started together, for all of them:
    :func:`~workers.sources.tars.node_listing`), for the files' names and identities."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._listed: dict[str, dict[str, Identity] | None] = {}

    def __call__(self, directory: str) -> dict[str, Identity] | None:
        if directory not in self._listed:
            self._listed[directory] = node_listing(self.storage, directory)
        return self._listed[directory]

    def identities(self, files: Sequence[str]) -> list[Identity]:
        """(size, version) of each file: from its directory's listing (a remote one), else
        asked of the store; ``FileNotFoundError`` naming a missing one."""
        storage = self.storage
        if storage.local:
            return storage.identities(files)
        found = []
        for path in files:
            listed = self(storage.dirname(path))
            identity = None if listed is None else listed.get(storage.basename(path))
            found.append(identity if identity is not None else storage.identity(path))
        return found


class Summaries:
    """Each directory's summary read once (a remote one once per node: :func:`node_read`)."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._read: dict[str, tuple[dict[str, FileEntry], str] | None] = {}

    def __call__(self, directory: str) -> tuple[dict[str, FileEntry], str] | None:
        if directory not in self._read:
            storage, url = self.storage, summary_url(self.storage, directory)
            if storage.local:
                try:
                    stored: bytes | None = storage.read_all(url)
                except FileNotFoundError:
                    stored = None
            else:
                stored = node_read(storage, url)
            self._read[directory] = read_summary(storage, directory, stored)
        return self._read[directory]

    def entry(self, url: str) -> tuple[FileEntry, str] | None:
        """The summary's entry of the file ``url`` and the summary's place; None if none."""
        storage = self.storage
        found = self(storage.dirname(url))
        if found is None:
            return None
        entry = found[0].get(storage.basename(url))
        return None if entry is None else (entry, found[1])


def _rows_of_groups(footer: Any) -> list[int]:
    return [footer.row_group(k).num_rows for k in range(footer.num_row_groups)]


def read_footer(storage: Storage, url: str, size: int) -> Any:
    """The footer (``pyarrow.parquet.FileMetaData``) of the Parquet file at ``url`` of ``size``
    bytes, from one ranged read of its tail (two when the footer is longer); ``ValueError``
    naming the file when it is not Parquet or its footer is damaged."""
    pyarrow_modules()
    return parse_footer(url, read_footer_bytes(storage, url, size))


_chunk_range = chunk_range


#: Of a row group's requested bytes, the most that the gaps read between its requested column
#: chunks (columns not asked for, lying between them) may add: a request each is saved where a
#: gap is smaller, and the bytes read stay within 1.05x of the columns' chunks.
GAP_SHARE = 0.05


def read_ranges(spans: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """The byte ranges to read for column chunks at ``spans``: one range where they lie side by
    side (the common case: one request per row group), more where columns not asked for lie
    between them. A gap is read through (one request instead of two) while the gaps read
    through add up to at most :data:`GAP_SHARE` of the chunks' bytes."""
    ordered = sorted(spans)
    wanted = sum(end - start for start, end in ordered)
    allowance = GAP_SHARE * wanted
    ranges = [list(ordered[0])]
    for start, end in ordered[1:]:
        last = ranges[-1]
        gap = start - last[1]
        if gap <= 0:
            last[1] = max(last[1], end)
        elif gap <= allowance:
            allowance -= gap
            last[1] = end
        else:
            ranges.append([start, end])
    return tuple((start, end) for start, end in ranges)


def _outside(url: str, group: int, meta: Any, size: int, footer_size: int) -> str | None:
    """Why row group ``group`` (its metadata ``meta``) of ``url`` cannot be read, where one of
    its column chunks (read or not) lies outside the file's data, before its footer; else
    None."""
    whole = [_chunk_range(meta.column(k)) for k in range(meta.num_columns)]
    first, last = min(s for s, _e in whole), max(e for _s, e in whole)
    if first >= 4 and last <= size - 8 - footer_size:
        return None
    return (
        f"{url}: row group {group} (bytes {first}-{last}) lies outside the file's data "
        f"({size} bytes, its footer included): the file is truncated or damaged"
    )


class ParquetPlan:
    """The row groups of a Parquet dataset and what one epoch needs of them (see the module
    docstring). ``counts``/``starts``: rows per row group and the first sample id of each, for
    the epoch's order (:class:`~workers.sources.tars.TarOrder` deals them as it deals shards)."""

    def __init__(
        self,
        urls: list[str],
        identities: list[Identity],
        footers: Any,
        kinds: list[ColumnKind],
        storage: Storage,
        skip_damaged: bool = False,
        parsed: Iterable[Any] | None = None,
    ) -> None:
        """``parsed``: the files' footers, parsed (else taken from ``footers`` one by one)."""
        self.urls, self.identities, self.footers = urls, identities, footers
        self.kinds, self.storage = kinds, storage
        #: per file, the summary its identity and footer come from (not yet confirmed by the
        #: store: a read checks it), or None where the store told them
        self.vouched: list[str | None] = [None] * len(urls)
        #: per file: its rows, and each of its row groups' rows (for the fingerprint and the
        #: state's parts, without parsing every footer again)
        self.file_rows: list[int] = []
        self.group_rows: list[list[int]] = []
        wanted = {kind.name for kind in kinds}
        files, groups, rows, begins, ends, decoded = [], [], [], [], [], []
        #: per row group: the byte ranges read of it (its requested columns' chunks, those
        #: apart by more than a small gap read apart: see :func:`read_ranges`)
        self.ranges: list[tuple[tuple[int, int], ...]] = []
        self.damaged: list[str] = []
        #: per file, the requested columns' leaves (chunks), which a read selects by number
        self.leaves: list[list[int]] = []  # (a name may be another's path: a.b beside a{b})
        given = footers if parsed is None else parsed
        for number, (url, footer) in enumerate(zip(urls, given, strict=True)):
            size = identities[number][0]
            self.file_rows.append(int(footer.num_rows))
            self.group_rows.append(_rows_of_groups(footer))
            self.leaves.append(leaves := leaf_columns(footer, wanted))
            for group in range(footer.num_row_groups):
                meta = footer.row_group(group)
                if meta.num_rows == 0:
                    continue
                spans = [_chunk_range(meta.column(k)) for k in leaves]
                begin, end = min(s for s, _e in spans), max(e for _s, e in spans)
                pieces = read_ranges(spans)
                why = _outside(url, group, meta, size, footer.serialized_size)
                if why is not None:
                    if not skip_damaged:
                        raise ValueError(why)
                    self.damaged.append(f"{why}; its {meta.num_rows} rows are left out")
                    continue
                files.append(number)
                groups.append(group)
                rows.append(meta.num_rows)
                begins.append(begin)
                ends.append(end)
                decoded.append(sum(int(meta.column(k).total_uncompressed_size) for k in leaves))
                self.ranges.append(pieces)
        if not rows:
            raise ValueError(f"no rows to read in {', '.join(urls[:3])}: every file is empty")
        #: per row group: its file, its number in the file, its byte range
        self.files = np.asarray(files, np.int64)
        self.groups = np.asarray(groups, np.int64)
        self.begins = np.asarray(begins, np.int64)
        self.ends = np.asarray(ends, np.int64)
        #: per row group: the bytes its requested columns take decoded (their chunks'
        #: uncompressed sizes: what sizes a large one's record batches, :func:`._sparse.batch_rows`)
        self.decoded = np.asarray(decoded, np.int64)
        #: per row group: the bytes its reads take (the ranges' sum)
        self.sizes = np.asarray([sum(e - b for b, e in r) for r in self.ranges], np.int64)
        self.counts = np.asarray(rows, np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)[:-1]]).astype(np.int64)
        self.total = int(self.counts.sum())
        self._starts_list: list[int] = self.starts.tolist()

    def unit_of(self, index: int) -> tuple[int, int]:
        """(row group unit, row in it) of sample ``index``."""
        import bisect

        unit = bisect.bisect_right(self._starts_list, index) - 1
        return unit, index - self._starts_list[unit]

    def name(self, unit: int) -> str:
        """``<file>, row group <k>`` of a unit."""
        return f"{self.urls[int(self.files[unit])]}, row group {int(self.groups[unit])}"

    def fingerprint(self) -> str:
        """``parquet:`` and a hash of the files' names (not where they are kept), sizes, row
        groups' rows and the requested columns' kinds: the same files copied elsewhere keep it."""
        digest = hashlib.sha256()
        for kind in self.kinds:
            digest.update(f"{kind.name}\0{kind.kind}\0{kind.type}\n".encode())
        for url, (size, _version), groups in zip(
            self.urls, self.identities, self.group_rows, strict=True
        ):
            digest.update(f"{posixpath.basename(url)}\0{size}\0{groups}\n".encode())
        return f"parquet:{digest.hexdigest()[:16]}"

    def parts(self) -> str:
        """Each file's name, size and rows, for a state (:mod:`workers.sources.plan._parts`)."""
        return encode_parts(
            "file",
            [
                (posixpath.basename(url), size, rows)
                for url, (size, _v), rows in zip(
                    self.urls, self.identities, self.file_rows, strict=True
                )
            ],
        )

    def left_out(self) -> tuple[str, ...]:
        return tuple(self.damaged)


def open_plan(
    urls: str | os.PathLike[str] | Sequence[str],
    columns: tuple[str, ...],
    storage_options: dict[str, Any] | None = None,
    retries: int = RETRIES,
    skip_damaged: bool = False,
) -> ParquetPlan:
    """List the files, read their footers (in parallel) and check their columns."""
    pyarrow_modules()  # (the extra's error first)
    first = os.fspath(urls) if isinstance(urls, (str, os.PathLike)) else None
    if first is None:
        listed_urls = [os.fspath(u) for u in urls]  # type: ignore[union-attr]
        if not listed_urls:
            raise ValueError("no Parquet files: the list of paths/URLs is empty")
        first = listed_urls[0]
    storage = storage_for(first, storage_options, retries)
    listings, summaries = Listings(storage), Summaries(storage)
    files = list_parquet(urls, storage, listings, summaries)
    entries = [summaries.entry(url) for url in files]
    identities = _identities(storage, listings, files, entries)
    stale = [
        (url, entry[0], identity)
        for url, entry, identity in zip(files, entries, identities, strict=True)
        if entry is not None and entry[0].identity != identity
    ]
    if stale:
        warn_stale(stale, entries, urls)
    fresh = {
        number: entry
        for number, entry in enumerate(entries)
        if entry is not None and entry[0].identity == identities[number]
    }

    def footer(number: int) -> bytes:
        url = files[number]
        try:
            return read_footer_bytes(storage, url, identities[number][0])
        except (ValueError, StorageFailure):
            raise
        except (OSError, EOFError) as error:
            raise storage_failure(url, error) from error

    unread = [n for n in range(len(files)) if n not in fresh]
    spoilable = set() if storage.local else set(unread)  # (a node cache's entry may be spoilt)
    kept = KeptFooters(files, reread=lambda n: footer(n) if n in spoilable else None)
    node_footers_into(
        storage,
        [files[n] for n in unread],
        [identities[n] for n in unread],
        lambda k: footer(unread[k]),
        lambda k, data: kept.put(unread[k], data),
    )
    for number, (entry, _where) in fresh.items():
        kept.put(number, entry)  # (kept as the summary keeps it)
    kinds, checked = _checked_footers(files, kept, fresh, urls, columns)
    plan = ParquetPlan(files, identities, kept, kinds, storage, skip_damaged, parsed=checked)
    plan.vouched = [fresh[n][1] if n in fresh else None for n in range(len(files))]
    return plan


def _checked_footers(
    files: list[str],
    kept: KeptFooters,
    fresh: dict[int, tuple[FileEntry, str]],
    given: Any,
    columns: tuple[str, ...],
) -> tuple[list[ColumnKind], Iterator[Any]]:
    """The kinds of ``columns`` (the first file's), and each file's footer parsed once, in
    order, checked as it comes: against the summary's entry where a summary gave it
    (:func:`_summarised`), and its columns' types against the first file's (a file whose Parquet
    schema and Arrow schema metadata are the first's is not looked at again)."""

    def footer_of(number: int) -> Any:
        if number in fresh:
            return _summarised(files[number], kept, number, *fresh[number], given)
        return kept[number]

    first = footer_of(0)
    first_arrow = (first.metadata or {}).get(b"ARROW:schema")
    kinds = column_kinds(first.schema.to_arrow_schema(), columns, files[0])

    def each() -> Iterator[Any]:
        yield first
        for number in range(1, len(files)):
            footer = footer_of(number)
            arrow = (footer.metadata or {}).get(b"ARROW:schema")
            if arrow != first_arrow or not footer.schema.equals(first.schema):
                agree(kinds, files[0], files[number], footer.schema.to_arrow_schema(), columns)
            yield footer

    return kinds, each()


def _identities(
    storage: Storage, listings: Listings, files: list[str], entries: list[Any]
) -> list[Identity]:
    """Each file's (size, version): a local one's from the disk, a remote one's from the
    summary's entry (checked by the reads) or else from its directory's listing."""
    try:
        if storage.local:
            return listings.identities(files)
        missing = [url for url, entry in zip(files, entries, strict=True) if entry is None]
        listed = iter(listings.identities(missing))
        return [entry[0].identity if entry is not None else next(listed) for entry in entries]
    except StorageFailure:
        raise
    except FileNotFoundError as error:
        if not error.filename:  # (a store's own words, naming the object)
            raise FileNotFoundError(f"{error.strerror or error}") from None
        raise FileNotFoundError(
            f"{error.filename}: no such file or directory (give Parquet files, a directory of "
            "them, a glob or a URL)"
        ) from None


def _summarised(
    url: str, kept: KeptFooters, number: int, entry: FileEntry, where: str, given: Any
) -> Any:
    """The footer of ``url`` (file ``number`` of ``kept``) kept in the summary ``where``:
    ``ValueError`` naming the summary and the command that mends it when the entry's row
    groups are not its footer's."""
    try:
        footer = kept[number]
    except ValueError as error:
        raise ValueError(
            f"the summary {where} is wrong about {url}: {error}. Run "
            f"{index_command(shown_urls(given), force=True)} (it reads the file's footer again and "
            "rewrites its entry), then restart the job"
        ) from None
    if groups_of(footer) != entry.groups or int(footer.num_rows) != entry.rows:
        raise ValueError(
            f"the summary {where} is wrong about {url}: its row groups or rows are not those "
            "of the footer it keeps for the file (the summary was edited, or written for other "
            f"data). Run {index_command(shown_urls(given), force=True)} (it reads the file's "
            "footer again and rewrites its entry), then restart the job"
        )
    return footer


#: The plan this process opened last, with the arguments it opened it with.
_opened: OpenedOnce[ParquetPlan] = OpenedOnce()


def open_plan_once(
    urls: str | os.PathLike[str] | Sequence[str],
    columns: tuple[str, ...],
    storage_options: dict[str, Any] | None,
    retries: int,
) -> ParquetPlan:
    """:func:`open_plan`, once per worker and arguments (see
    :class:`~workers.sources.plan.OpenedOnce`): a source built again (a resume's seek) keeps the
    plan made at the worker's start (the files are checked again as they are read: their
    identities)."""
    names = os.fspath(urls) if isinstance(urls, (str, os.PathLike)) else tuple(urls)
    return _opened.get(
        (names, columns, retries),
        storage_options,
        lambda: open_plan(urls, columns, storage_options, retries, SKIP_DAMAGED.get()),
    )
