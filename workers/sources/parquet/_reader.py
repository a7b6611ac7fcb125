"""``load(index)`` over a Parquet plan: row groups read with one ranged read each, ahead of their
need, their columns held as numpy views. Runs in the worker.

A row group is read whole, over the requested columns only: one ranged read of the bytes from
its first requested chunk to the end of its last (:attr:`ParquetPlan.begins`/``ends``), handed to
pyarrow as the only bytes of a sparse file of the real file's size (with the footer the plan
read: pyarrow asks for nothing else), and decoded to :class:`~._columns.Values`. A sample is then
a row of those: slices of Arrow's buffers, no copy and no Python object per row. Where an epoch
needs only some rows of a large row group (a worker's part of one the layout cuts, the rows a
resume still owes) and the file has a page index, only the pages that hold them are read
(:mod:`._pages`; ``page_index=False`` reads the whole row group).

The loader is told each epoch's batches (``expect``) and each batch loaded (``passed``): a row
group is read on a background thread when the batch being loaded needs it, or shortly before
(at most ``ahead`` waiting and, past the first, ``ahead_bytes`` of them), and dropped once the
last batch that needs it is loaded. Remote reads check the file's identity (on S3 from the GET
itself: a file rewritten since the start is named, never read as another's rows).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np

from ..files import ImageTooLargeError, over_limit
from ..plan import Defaulted, MemberMissing
from ..storage import (
    IdentityChanged,
    StorageFailure,
    count_read,
    is_url,
    storage_failure,
    storage_for,
)
from . import _pages as pages
from ._arrow import note_compute, pyarrow_modules
from ._columns import ChunkedValues, Values, default_value, values_of
from ._footers import read_footer_bytes
from ._plan import ParquetPlan, read_ranges
from ._sparse import SparseFile, batch_rows
from ._summary import index_command

__all__ = ["DamagedRowGroup", "Held", "ParquetLoader", "SparseFile", "optional_defaults"]

_log = logging.getLogger(__name__)

#: Row groups read outside an epoch's plan (a ``load`` called on its own) that are kept.
_KEPT = 2
#: Background threads that read row groups.
_THREADS = 4


class Held(NamedTuple):
    """Rows ``[first, end)`` of a row group, read: each requested column's values."""

    first: int
    end: int
    values: Sequence[Values | ChunkedValues]


class DamagedRowGroup(ValueError):
    """A row group whose bytes cannot be decoded (a corrupt page, a bad checksum): its samples
    fail to load, so ``on_error="skip"`` skips them all, each named with the row group's byte
    range (read once: its other rows fail without another read)."""


def optional_defaults(
    kinds: Sequence[Any], optional: Mapping[str, Any] | None
) -> list[np.ndarray[Any, Any] | None]:
    """Per requested column (``kinds``: their :class:`~._columns.ColumnKind`), the default a
    null in it gives, from ``optional`` (column -> default); None for a required column.
    ``ValueError`` when ``optional`` names a column not requested."""
    optional = dict(optional or {})
    if not all(isinstance(name, str) for name in optional):
        raise TypeError("optional must be a dict of column -> default, e.g. {'caption': b''}")
    names = [kind.name for kind in kinds]
    unknown = [name for name in optional if name not in names]
    if unknown:
        raise ValueError(
            f"optional names {unknown[0]!r}, which is not among columns={tuple(names)}; "
            "name one of those"
        )
    return [
        default_value(kind, optional[kind.name]) if kind.name in optional else None
        for kind in kinds
    ]


class _Ahead:
    """Reads row groups on background threads as an epoch's batches come near them (see the
    module docstring): ``plan`` per epoch, ``passed`` per batch, ``get`` per load. ``read(unit,
    epoch, rows)``: a row group read for ``epoch`` (what the read counts go under), ``rows``
    ``[lo, hi)`` of it the epoch needs."""

    def __init__(
        self, read: Any, ahead: int, ahead_bytes: int | None, sizes: Any, counts: Any, pages: bool
    ) -> None:
        self.read, self.ahead, self.ahead_bytes, self.sizes = read, ahead, ahead_bytes, sizes
        #: per unit, its rows; whether units may be read by their pages
        self.counts, self.pages = counts, pages
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._held: dict[int, Future[Held]] = {}
        self._needs: list[tuple[int, int, int]] = []  # unit, first step, last step
        self._rows: dict[int, tuple[int, int]] = {}  # unit -> rows [lo, hi) the epoch needs
        self._next, self._step = 0, -1
        #: the epoch planned last (None before the first)
        self.epoch: int | None = None

    def plan(
        self, epoch: int, needs: list[tuple[int, int, int]], rows: dict[int, tuple[int, int]]
    ) -> None:
        with self._lock:
            kept = {u: f for u, f in self._held.items() if rows.get(u) == self._rows.get(u)}
            for unit, future in self._held.items():
                if unit not in kept:
                    future.cancel()
            self._held = kept
            self._needs, self._rows, self._next, self._step = needs, rows, 0, -1
            self.epoch = epoch
            if self._pool is None:
                self._pool = ThreadPoolExecutor(_THREADS, "parquet-read")
            self._schedule()

    def passed(self, step: int) -> None:
        with self._lock:
            self._step = step
            for unit, _first, last in self._needs[: self._next]:
                if last <= step:
                    self._held.pop(unit, None)
            if self._pool is not None:
                self._schedule()

    def _schedule(self) -> None:
        assert self._pool is not None
        loading = self._step + 1
        while self._next < len(self._needs):
            unit, first, _last = self._needs[self._next]
            if unit not in self._held:
                if first > loading and not self._may_read_ahead(first, loading, unit):
                    return
                rows = self._rows.get(unit)
                self._held[unit] = self._pool.submit(self.read, unit, self.epoch, rows)
            self._next += 1

    def _may_read_ahead(self, first: int, loading: int, unit: int) -> bool:
        waiting = [u for u, f, _l in self._needs[: self._next] if f > loading and u in self._held]
        if len(waiting) >= self.ahead:
            return False
        if self.ahead_bytes is None or not waiting:
            return True
        held = sum(self._bytes(u) for u in waiting)
        return held + self._bytes(unit) <= self.ahead_bytes

    def _bytes(self, unit: int) -> int:
        """What reading ``unit`` for this epoch takes: its rows' share of its bytes where the
        epoch needs few enough of its rows to read their pages, else all of them."""
        size, rows = int(self.sizes[unit]), self._rows.get(unit)
        count = int(self.counts[unit])
        if not self.pages or rows is None or not pages.worth_it(size, count, rows):
            return size
        return size * (rows[1] - rows[0]) // max(1, count)

    def get(self, unit: int) -> Future[Held] | None:
        with self._lock:
            return self._held.get(unit)

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None
            self._held.clear()


class ParquetLoader:
    """``load(index)`` of :func:`sharded_parquet`: one output per requested column."""

    def __init__(
        self,
        plan: ParquetPlan,
        ahead: int = 2,
        ahead_bytes: int | None = None,
        max_pixels: int | None = None,
        optional: Mapping[str, Any] | None = None,
        page_index: bool = True,
    ) -> None:
        self.plan, self.max_pixels, self.page_index = plan, max_pixels, page_index
        self.names = [kind.name for kind in plan.kinds]
        #: per column, the default a null gives (None: a null fails the sample)
        self.defaults = optional_defaults(plan.kinds, optional)
        self._lock = threading.Lock()
        self._kept: OrderedDict[int, Sequence[Values | ChunkedValues]] = OrderedDict()
        self._ahead = _Ahead(
            self._read_unit, ahead, ahead_bytes, plan.sizes, plan.counts, page_index
        )
        #: row groups found undecodable, and why
        self._damaged: dict[int, DamagedRowGroup] = {}
        #: ranged reads made and their bytes (row groups and images kept as files)
        self.requests = 0
        self.bytes_read = 0

    # -- reading -----------------------------------------------------------------------------

    def _read_bytes(
        self, file: int, start: int, end: int, epoch: int | None, row_groups: int = 1
    ) -> np.ndarray[Any, Any]:
        """Bytes ``start``-``end`` of ``file``, one ranged read, counted for ``epoch`` (with
        ``row_groups`` row groups: 0 for a row group's second range)."""
        plan = self.plan
        url, identity = plan.urls[file], plan.identities[file]
        storage = plan.storage
        check = storage.can_check(identity)
        try:
            data = storage.read(url, start, end, expect=identity if check else None)
        except IdentityChanged as error:
            where = plan.vouched[file]
            if where is not None:
                raise StorageFailure(
                    f"{url} changed since it was indexed "
                    f"({IdentityChanged.change(error.expected, error.found)}): "
                    f"the summary {where} that this job planned its epochs with is stale for "
                    f"it. Run {index_command(plan.storage.dirname(url))} (it reads the changed "
                    "file's footer and rewrites the summary), then restart the job"
                ) from error
            raise StorageFailure(
                f"{url} changed since the job planned its epochs "
                f"({IdentityChanged.change(error.expected, error.found)}): restart the job over "
                "the files as they are now"
            ) from error
        except StorageFailure:
            raise
        except FileNotFoundError as error:
            where = plan.vouched[file]
            if where is None:
                raise StorageFailure(
                    f"{error.strerror or error}: removed since the job planned its epochs; "
                    "restart the job over the files as they are now (or put it back)"
                ) from error
            raise StorageFailure(
                f"{error.strerror or error}: removed since the summary {where} that names it "
                f"was written; run {index_command(plan.storage.dirname(url))} (it rewrites "
                "the summary without it), then restart the job (or put it back)"
            ) from error
        except (OSError, EOFError) as error:
            raise storage_failure(url, error) from error
        with self._lock:
            self.requests += 1
            self.bytes_read += end - start
        count_read(row_groups, 1, end - start, epoch)
        return data

    def _read_unit(self, unit: int, epoch: int | None, rows: tuple[int, int] | None = None) -> Held:
        """Read and decode row group ``unit`` for ``epoch`` (on a background thread, or on the
        loading one): rows ``[lo, hi)`` of it by their pages where that is worth it
        (:mod:`._pages`), else the whole row group."""
        plan = self.plan
        count, size = int(plan.counts[unit]), int(plan.sizes[unit])
        if self.page_index and rows is not None and pages.worth_it(size, count, rows):
            held = self._read_pages(unit, epoch, *rows)
            if held is not None:
                return held
        pa, pq = pyarrow_modules()
        file, group = int(plan.files[unit]), int(plan.groups[unit])
        url = plan.urls[file]
        pieces = {
            start: self._read_bytes(file, start, stop, epoch, row_groups=int(k == 0))
            for k, (start, stop) in enumerate(plan.ranges[unit])
        }
        sparse = SparseFile(url, plan.identities[file][0], pieces)
        try:
            reader = pq.ParquetFile(
                pa.PythonFile(sparse, mode="r"),
                metadata=plan.footers[file],
                page_checksum_verification=True,  # (pages written with a CRC: a bad one fails)
                # (each column chunk read by its own range: pre-buffering reads the chunks
                # together, through the bytes between them, which a writer may leave (polars
                # does) and the row group's read did not fetch)
                pre_buffer=False,
            )
            per_batch = batch_rows(count, max(size, int(plan.decoded[unit])))
            # (the columns' leaves by number, not by name: a name may be another's path)
            leaves, arrow = plan.leaves[file], reader.reader
            batches = list(arrow.iter_batches(per_batch, [group], leaves, use_threads=False))
            table = (
                pa.Table.from_batches(batches)
                if batches
                else arrow.read_row_group(group, leaves, use_threads=False)
            )
            return Held(0, count, values_of(plan.kinds, table))
        except Exception as error:
            raise self._damaged_by(unit, error) from None

    def _damaged_by(self, unit: int, error: Exception) -> DamagedRowGroup:
        """Row group ``unit`` did not decode (``error``): a summary that lies is named (see
        :meth:`_check_summary`); else the row group is damaged, and kept so."""
        plan = self.plan
        file, group = int(plan.files[unit]), int(plan.groups[unit])
        begin, end = int(plan.begins[unit]), int(plan.ends[unit])
        self._check_summary(file)
        damaged = DamagedRowGroup(
            f"{plan.urls[file]}: row group {group} (bytes {begin}-{end}) cannot be read "
            f"({type(error).__name__}: {error}); its {int(plan.counts[unit])} rows are "
            'left out under on_error="skip"'
        )
        with self._lock:
            self._damaged[unit] = damaged
        return damaged

    def _read_pages(self, unit: int, epoch: int | None, lo: int, hi: int) -> Held | None:
        """Rows ``[lo, hi)`` of row group ``unit`` from the pages that hold them: one read of
        the columns' offset indexes, then their pages' ranges; None (the row group is read
        whole) where the file has no page index, or one that does not describe its pages."""
        plan = self.plan
        file, group = int(plan.files[unit]), int(plan.groups[unit])
        try:
            footer = pages.decode_footer(plan.footers.data(file))
            columns = pages.leaves_of(footer, self.names)
            flat = [leaf for leaves in columns or () for leaf in leaves]
            where = pages.index_range(footer, group, flat) if columns else None
            if columns is None or where is None or where[1] > plan.identities[file][0]:
                return None
            index = self._read_bytes(file, *where, epoch, row_groups=0).tobytes()
            parts = pages.pages_for(footer, group, flat, index, where[0], lo, hi)
        except ValueError as error:
            _log.debug("%s: read whole, its page index not used: %s", plan.name(unit), error)
            return None
        spans = [span for part in parts for span in (part.dictionary, part.pages) if span]
        pieces = [
            (start, self._read_bytes(file, start, stop, epoch, row_groups=int(k == 0)))
            for k, (start, stop) in enumerate(read_ranges(spans))
        ]

        def piece(span: tuple[int, int] | None) -> memoryview:
            if span is None:
                return memoryview(b"")
            start, data = next(p for p in pieces if p[0] <= span[0] < p[0] + len(p[1]))
            return data[span[0] - start : span[1] - start].data

        try:
            pa, pq = pyarrow_modules()
            note_compute()
            arrays = {}
            for part in parts:
                array = pages.read_part(
                    pq, pa, footer, group, part, piece(part.dictionary), piece(part.pages)
                )
                arrays[part.leaf] = array.slice(lo - part.rows[0], hi - lo)
            values = [
                Values(
                    kind.kind, pages.put_together(pa, [arrays[leaf] for leaf in leaves]), kind.name
                )
                for kind, leaves in zip(plan.kinds, columns, strict=True)
            ]
        except pages.IndexLies as error:
            _log.warning(
                "%s: read whole, its page index does not tell its pages: %s", plan.name(unit), error
            )
            return None
        except Exception as error:
            raise self._damaged_by(unit, error) from None
        return Held(lo, hi, values)

    def _check_summary(self, file: int) -> None:
        """A row group of ``file`` did not decode: when its footer came from a summary, read the
        file's own footer; ``StorageFailure`` naming the summary (and the command that mends
        it) when the two differ -- the summary lies, the file is not damaged."""
        plan = self.plan
        where = plan.vouched[file]
        if where is None:
            return
        url = plan.urls[file]
        try:
            own = read_footer_bytes(plan.storage, url, plan.identities[file][0])
        except (OSError, ValueError):
            return
        if plan.footers.data(file) != own:
            raise StorageFailure(
                f"the summary {where} is wrong about {url}: the footer it keeps for the file "
                "is not the file's (the summary was edited, or written for other data). Run "
                f"{index_command(plan.storage.dirname(url), force=True)} (it reads the file's "
                "footer again and rewrites its entry), then restart the job"
            )

    def _values(self, unit: int, row: int) -> tuple[int, Sequence[Values | ChunkedValues]]:
        """The values of row group ``unit`` that hold ``row``, and the row they begin at."""
        damaged = self._damaged.get(unit)
        if damaged is not None:  # (read once: its other rows fail at once, not read again)
            raise DamagedRowGroup(str(damaged))
        future = self._ahead.get(unit)
        if future is not None:
            held = future.result()
            if held.first <= row < held.end:
                return held.first, held.values
        with self._lock:
            kept = self._kept.get(unit)
        if kept is None:
            kept = self._read_unit(unit, self._ahead.epoch).values
            with self._lock:
                self._kept[unit] = kept
                while len(self._kept) > _KEPT:
                    self._kept.popitem(last=False)
        return 0, kept

    # -- the source's interface --------------------------------------------------------------

    def describe(self, index: int) -> str:
        """``<file>, row group <k>, row <r>`` of sample ``index`` (and, in a row group found
        damaged, the byte range that cannot be read)."""
        unit, row = self.plan.unit_of(index)
        where = f"{self.plan.name(unit)}, row {row}"
        if unit not in self._damaged:
            return where
        begin, end = int(self.plan.begins[unit]), int(self.plan.ends[unit])
        return f"{where} (its row group's bytes {begin}-{end} cannot be read)"

    def __call__(self, index: int) -> tuple[np.ndarray[Any, Any], ...]:
        unit, row = self.plan.unit_of(index)
        first, columns = self._values(unit, row)
        row -= first
        outputs, defaulted = [], []
        for name, values, default in zip(self.names, columns, self.defaults, strict=True):
            try:
                value = values.row(row)
            except ValueError as error:  # (a value it cannot give: where it is)
                raise ValueError(f"{self.describe(index)}: {error}") from None
            if value is None and default is not None:
                outputs.append(default)
                defaulted.append(name)
                continue
            if value is None:
                fix = (
                    "a row without its image (a failed download) has nothing to train on:"
                    if values.kind == "image"
                    else f"if rows may lack it, make it optional (optional={{{name!r}: default}}),"
                )
                raise MemberMissing(
                    f"{self.describe(index)}: column {name!r} is null; {fix} filter such rows "
                    'out of the dataset, or pass on_error="skip" to skip them',
                    name,
                )
            if isinstance(value, str):
                value = self._image_file(unit, value)
            if values.kind == "image":
                self._check_pixels(value, index, name)
            outputs.append(value)
        return Defaulted(outputs, defaulted) if defaulted else tuple(outputs)

    def _image_file(self, unit: int, path: str) -> np.ndarray[Any, Any]:
        """The bytes of an image kept as a file (an ``Image`` row with ``path`` and no
        ``bytes``): ``path`` as a URL, an absolute path, or relative to :meth:`_image_base`."""
        url = self.plan.urls[int(self.plan.files[unit])]
        if not is_url(path) and not os.path.isabs(path):
            path = self.plan.storage.join(self._image_base(url), path)
        storage = storage_for(path) if is_url(path) != is_url(url) else self.plan.storage
        try:
            data = storage.read_all(path)
        except (OSError, EOFError) as error:
            raise FileNotFoundError(
                f"{url}: its image file {path} cannot be read: {error}"
            ) from None
        with self._lock:
            self.requests += 1
            self.bytes_read += len(data)
        count_read(0, 1, len(data), self._ahead.epoch)
        return np.frombuffer(data, np.uint8)

    def _image_base(self, url: str) -> str:
        """Where a relative image ``path`` of file ``url`` is: the Parquet file's directory."""
        return str(self.plan.storage.dirname(url))

    def _check_pixels(self, value: np.ndarray[Any, Any], index: int, column: str) -> None:
        size = over_limit(value, self.max_pixels)
        if size is None:
            return
        assert self.max_pixels is not None
        name = f"{self.describe(index)} ({column})"
        raise ImageTooLargeError.of(name, size, self.max_pixels, "sharded_parquet")

    def expect(self, epoch: int, ids: Sequence[np.ndarray[Any, Any]]) -> None:
        """The epoch's batches (sample ids per step): plan the reads of their row groups."""
        if not ids:
            return
        flat = np.concatenate([np.asarray(chunk, dtype=np.int64) for chunk in ids])
        steps = np.repeat(np.arange(len(ids)), [len(chunk) for chunk in ids])
        units = np.searchsorted(self.plan.starts, flat, side="right") - 1
        found, first_at = np.unique(units, return_index=True)
        last_step = np.zeros(len(found), np.int64)
        np.maximum.at(last_step, np.searchsorted(found, units), steps)
        rows = flat - self.plan.starts[units]
        low = np.full(len(found), np.iinfo(np.int64).max, np.int64)
        high = np.zeros(len(found), np.int64)
        np.minimum.at(low, np.searchsorted(found, units), rows)
        np.maximum.at(high, np.searchsorted(found, units), rows + 1)
        order = np.argsort(first_at, kind="stable")
        needs = [
            (int(found[k]), int(steps[first_at[k]]), int(last_step[k])) for k in order.tolist()
        ]
        spans = {int(u): (int(a), int(b)) for u, a, b in zip(found, low, high, strict=True)}
        self._ahead.plan(epoch, needs, spans)

    def passed(self, epoch: int, step: int) -> None:
        self._ahead.passed(step)

    def __del__(self) -> None:
        ahead = getattr(self, "_ahead", None)
        if ahead is not None:
            ahead.close()
