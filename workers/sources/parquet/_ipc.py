"""A Hugging Face ``datasets.Dataset`` read where it lies: its memory-mapped Arrow files (what
``load_dataset`` and ``load_from_disk`` leave in ``dataset.cache_files``, in Arrow's IPC stream
format, not Parquet), each record batch a unit as a Parquet row group is. Runs in the worker (and
:func:`arrow_files_of` in the trainer, where the dataset is given).

The trainer sends the workers :class:`ArrowFiles` (the files' paths, the dataset's fingerprint and
its rows), never the ``Dataset`` itself. A worker maps each file (``pyarrow.memory_map``) and
walks its stream once for its record batches' rows (their bytes stay in the page cache; nothing
is copied); a batch's columns are then views of the mapped file, with the same conversions as a
Parquet row group's (:mod:`._columns`). The dataset's fingerprint goes into the state: a state
saved over another dataset is refused.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..plan import encode_parts
from ..storage import storage_for
from ._arrow import pyarrow_modules
from ._columns import values_of
from ._plan import ParquetPlan, checked_schemas
from ._reader import Held, ParquetLoader

__all__ = ["ArrowFiles", "ArrowLoader", "ArrowPlan", "arrow_files_of"]


@dataclass(frozen=True)
class ArrowFiles:
    """What a worker needs of a ``datasets.Dataset``: its Arrow files, fingerprint and rows."""

    paths: tuple[str, ...]
    fingerprint: str
    rows: int


def arrow_files_of(dataset: Any) -> ArrowFiles:
    """The :class:`ArrowFiles` of a ``datasets.Dataset``; ``ValueError`` saying what to do when
    its rows are not those of its files (held in memory, or a selection of them)."""
    if not hasattr(dataset, "cache_files"):
        raise TypeError(
            f"a {type(dataset).__name__} has no Arrow files to read: pass a datasets.Dataset "
            "(load_dataset(..., streaming=False) or load_from_disk), or its Parquet files' "
            "paths or URLs"
        )
    if isinstance(dataset.cache_files, dict):  # (a DatasetDict: {split: its files})
        splits = ", ".join(repr(name) for name in dataset)
        first = next(iter(dataset), "train")
        raise TypeError(
            f"a {type(dataset).__name__} is a dict of splits ({splits}): pass one split, "
            f"dataset[{first!r}], or load one with load_dataset(..., split={first!r})"
        )
    files = [entry["filename"] for entry in (dataset.cache_files or [])]
    if not files:
        raise ValueError(
            "the datasets.Dataset is held in memory, not in Arrow files: save it with "
            "dataset.save_to_disk(path) and pass datasets.load_from_disk(path)"
        )
    if getattr(dataset, "_indices", None) is not None or _sliced(dataset):
        raise ValueError(
            "the datasets.Dataset is a selection (shuffle, select, filter...) of its Arrow "
            "files: pass dataset.flatten_indices() (which writes the selection), or the "
            "dataset before selecting (the loader shuffles it itself)"
        )
    fingerprint = str(getattr(dataset, "_fingerprint", "") or "")
    return ArrowFiles(tuple(os.fspath(f) for f in files), fingerprint, len(dataset))


def _sliced(dataset: Any) -> bool:
    """Whether the dataset's table holds a part of its Arrow files (``select(range(a, b))``
    slices the memory-mapped tables, with no indices to tell it): a block that replays a slice."""
    table = getattr(dataset, "data", None)
    blocks = getattr(table, "blocks", None)  # (a table over several files: one per file)
    tables = (
        [table]
        if not isinstance(blocks, list)
        else [block for row in blocks for block in (row if isinstance(row, list) else [row])]
    )
    return any(
        any(operation[0] == "slice" for operation in getattr(one, "replays", None) or ())
        for one in tables
    )


class ArrowPlan(ParquetPlan):
    """The record batches of a dataset's Arrow files, as :class:`ParquetPlan` holds row groups
    (``files``, ``groups``: the batch's number in its file, ``counts``, ``starts``; ``begins`` and
    ``ends``: the requested columns' bytes, for the default window; ``sizes``: the same, as a
    Parquet plan's read sizes)."""

    def __init__(self, arrow: ArrowFiles, columns: tuple[str, ...]) -> None:
        pa, _pq = pyarrow_modules()
        urls = list(arrow.paths)
        schemas, batches = [], []
        for path in urls:
            try:
                reader = pa.ipc.open_stream(pa.memory_map(path, "r"))
                batches.append(list(reader))
            except (OSError, pa.ArrowInvalid) as error:
                raise ValueError(
                    f"{path} cannot be read as an Arrow file of a datasets.Dataset "
                    f"({type(error).__name__}: {error}): the dataset's cache is damaged"
                ) from None
            schemas.append(reader.schema)
        self.urls, self.batches, self.arrow = urls, batches, arrow
        self.kinds = checked_schemas(urls, schemas, columns)
        self.storage = storage_for(urls[0])
        self.identities = self.storage.identities(urls)
        self.vouched = [None] * len(urls)
        self.footers: list[Any] = []
        self.damaged: list[str] = []
        names = [kind.name for kind in self.kinds]
        files, groups, rows, sizes = [], [], [], []
        for number, file_batches in enumerate(batches):
            for k, batch in enumerate(file_batches):
                if batch.num_rows == 0:
                    continue
                files.append(number)
                groups.append(k)
                rows.append(batch.num_rows)
                sizes.append(sum(batch.column(name).nbytes for name in names))
        total = sum(rows)
        if total != arrow.rows:
            raise ValueError(
                f"the datasets.Dataset has {arrow.rows} rows but its Arrow files "
                f"({', '.join(urls[:3])}) hold {total}: it is a selection of them; pass "
                "dataset.flatten_indices(), or the dataset it was selected from"
            )
        if not rows:
            raise ValueError(f"no rows to read in {', '.join(urls[:3])}: the dataset is empty")
        self.files = np.asarray(files, np.int64)
        self.groups = np.asarray(groups, np.int64)
        self.counts = np.asarray(rows, np.int64)
        self.begins = np.zeros(len(rows), np.int64)
        self.ends = np.asarray(sizes, np.int64)
        #: per record batch: the bytes its columns take (what a read-ahead budget counts)
        self.sizes = self.ends - self.begins
        self.starts = np.concatenate([[0], np.cumsum(self.counts)[:-1]]).astype(np.int64)
        self.total = int(total)
        self._starts_list = self.starts.tolist()

    def name(self, unit: int) -> str:
        return f"{self.urls[int(self.files[unit])]}, record batch {int(self.groups[unit])}"

    def fingerprint(self) -> str:
        """``hf-dataset:`` the dataset's fingerprint and a hash of the requested columns' kinds
        (without a fingerprint, of the files' names and rows)."""
        digest = hashlib.sha256()
        for kind in self.kinds:
            digest.update(f"{kind.name}\0{kind.kind}\0{kind.type}\n".encode())
        if not self.arrow.fingerprint:
            for url, file_batches in zip(self.urls, self.batches, strict=True):
                counts = [batch.num_rows for batch in file_batches]
                digest.update(f"{os.path.basename(url)}\0{counts}\n".encode())
        return f"hf-dataset:{self.arrow.fingerprint or '-'}:{digest.hexdigest()[:12]}"

    def parts(self) -> str:
        return encode_parts(
            "file",
            [
                (os.path.basename(url), size, sum(b.num_rows for b in file_batches))
                for url, (size, _v), file_batches in zip(
                    self.urls, self.identities, self.batches, strict=True
                )
            ],
        )


class ArrowLoader(ParquetLoader):
    """``load(index)`` over a dataset's mapped Arrow files: a record batch's columns as views of
    the mapping (no read, no copy; nothing fetched ahead)."""

    def __init__(
        self,
        plan: ArrowPlan,
        max_pixels: int | None = None,
        optional: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(plan, 0, None, max_pixels, optional)
        self.arrow_plan = plan

    def _read_unit(self, unit: int, epoch: int | None, rows: tuple[int, int] | None = None) -> Any:
        """Record batch ``unit``, whole (a view of the mapping: ``rows`` saves nothing)."""
        pa, _pq = pyarrow_modules()
        plan = self.arrow_plan
        batch = plan.batches[int(plan.files[unit])][int(plan.groups[unit])]
        with self._lock:
            self.bytes_read += int(plan.ends[unit])
        return Held(0, batch.num_rows, values_of(plan.kinds, pa.Table.from_batches([batch])))
