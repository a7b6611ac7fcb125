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
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..plan import encode_parts
from ..storage import storage_for
from ._arrow import pyarrow_modules
from ._columns import values_of
from ._plan import ParquetPlan
from ._reader import Held, ParquetLoader
from ._schemas import checked_schemas

__all__ = ["ArrowFiles", "ArrowLoader", "ArrowPlan", "arrow_files_of"]


@dataclass(frozen=True)
class ArrowFiles:
    """What a worker needs of a ``datasets.Dataset``: its Arrow files, fingerprint and rows;
    ``base``: where an ``Image`` row's relative ``path`` is (the working directory the dataset
    was given in: ``datasets`` opens such a path from the working directory)."""

    paths: tuple[str, ...]
    fingerprint: str
    rows: int
    base: str = ""


#: What ``datasets`` keeps in memory over a memory-mapped Arrow file that leaves the columns
#: it keeps as the file holds them: metadata, a slice (see :func:`_sliced`), one chunk.
_SAME_COLUMNS = frozenset({"replace_schema_metadata", "slice", "combine_chunks"})

_WRITE_IT = "pass dataset.flatten_indices(), which writes the dataset as it is to an Arrow file"


def arrow_files_of(dataset: Any, columns: tuple[str, ...] = ()) -> ArrowFiles:
    """The :class:`ArrowFiles` of a ``datasets.Dataset`` whose ``columns`` are read;
    ``ValueError`` saying what to do when its rows or those columns are not those of its files
    (held in memory, a selection of them, columns renamed or cast over them)."""
    if not hasattr(dataset, "cache_files"):
        raise TypeError(
            f"{_a(type(dataset).__name__)} has no Arrow files to read: pass a datasets.Dataset "
            "(load_dataset(..., streaming=False) or load_from_disk), or its Parquet files' "
            "paths or URLs"
        )
    if isinstance(dataset.cache_files, dict):  # (a DatasetDict: {split: its files})
        splits = ", ".join(repr(name) for name in dataset)
        first = next(iter(dataset), "train")
        raise TypeError(
            f"{_a(type(dataset).__name__)} is a dict of splits ({splits}): pass one split, "
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
    _check_columns(dataset, columns)
    fingerprint = str(getattr(dataset, "_fingerprint", "") or "")
    return ArrowFiles(tuple(os.fspath(f) for f in files), fingerprint, len(dataset), os.getcwd())


def _a(name: str) -> str:
    """``name`` with its article (``an IterableDataset``)."""
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _changed_in_memory(table: Any, columns: list[str]) -> str | None:
    """What ``datasets``' replays over a memory-mapped ``table`` change of the ``columns`` read
    (their names and Arrow types followed from the file's schema through each replay), as
    ``"renamed ..."``; None where those columns are the file's as it holds them (a cast to the
    same type, as ``cast_column("image", Image(decode=False))``, or fewer columns)."""
    pa, _pq = pyarrow_modules()
    try:
        schema = pa.ipc.open_stream(pa.memory_map(table.path, "r")).schema
    except (OSError, pa.ArrowInvalid):
        return None  # (named by the plan, in the worker: the dataset's cache is damaged)
    # (per column now: the name and type it has in the file)
    held = [(field.name, field.type) for field in schema]
    now = [field.name for field in schema]
    for operation, args, kwargs in table.replays:
        if operation in _SAME_COLUMNS:
            continue
        argument: Any = args[0] if args else next(iter(kwargs.values()), None)
        if operation == "drop" or operation == "select":
            keep = [now[k] if isinstance(k, int) else k for k in argument]
            if operation == "drop":
                keep = [name for name in now if name not in keep]
            held = [held[now.index(name)] for name in keep]
            now = keep
        elif operation == "remove_column":
            del held[argument], now[argument]
        elif operation == "rename_columns":
            now = (
                [argument.get(name, name) for name in now]
                if isinstance(argument, Mapping)
                else list(argument)
            )
        elif operation == "cast":
            for k, field in enumerate(argument):
                if now[k] in columns and field.type != held[k][1]:
                    return f"casts column {now[k]!r} from {held[k][1]} to {field.type}"
        else:
            return f"keeps {operation}"
    for name, (was, _type) in zip(now, held, strict=True):
        if name in columns and name != was:
            return f"renamed column {was!r} to {name!r}"
    return None


def _blocks(dataset: Any) -> list[list[Any]]:
    """The dataset's table as rows of tables side by side (``datasets``' ``ConcatenationTable``
    blocks; one table: one row of it)."""
    table = getattr(dataset, "data", None)
    blocks = getattr(table, "blocks", None)
    if not isinstance(blocks, list):
        return [[table]]
    return [list(row) if isinstance(row, list) else [row] for row in blocks]


def _check_columns(dataset: Any, columns: tuple[str, ...]) -> None:
    """The dataset's ``columns`` must be its Arrow files' as they are: ``ValueError`` naming
    what ``datasets`` holds in memory instead (rows or columns never written, columns side by
    side from several files, a rename or cast kept over the file), or a column it lacks. A
    transform (``with_transform``) is not the loader's to apply: a warning says so."""
    rows = _blocks(dataset)
    if any(getattr(one, "path", None) is None for row in rows for one in row):
        raise ValueError(
            "part of the datasets.Dataset is held in memory, not in its Arrow files (rows "
            "concatenated from a Dataset never saved, a column from add_column): " + _WRITE_IT
        )
    if any(len(row) > 1 for row in rows):
        raise ValueError(
            "the datasets.Dataset's columns come from several Arrow files side by side "
            "(concatenate_datasets(..., axis=1)): " + _WRITE_IT
        )
    names = list(getattr(dataset, "column_names", None) or ())
    for one in (one for row in rows for one in row if getattr(one, "replays", None)):
        changed = _changed_in_memory(one, [name for name in columns if name in names])
        if changed:
            raise ValueError(
                f"the datasets.Dataset {changed} in memory, over its Arrow file {one.path} "
                "(rename_column, cast_column and the like are not written to the file), and "
                "the loader reads the file: " + _WRITE_IT
            )
    missing = [name for name in columns if names and name not in names]
    if missing:
        raise ValueError(
            f"the datasets.Dataset has no column {missing[0]!r}; its columns: "
            f"{', '.join(names)}. Pass columns=(...) naming the ones to read"
        )
    if (getattr(dataset, "format", None) or {}).get("type") == "custom":
        warnings.warn(
            "the datasets.Dataset's transform (with_transform or set_transform) is not applied: "
            "the loader reads its Arrow files' columns as they are; do that work in step()",
            stacklevel=5,
        )


def _sliced(dataset: Any) -> bool:
    """Whether the dataset's table holds a part of its Arrow files (``select(range(a, b))``
    slices the memory-mapped tables, with no indices to tell it): a block that replays a slice."""
    return any(
        any(operation[0] == "slice" for operation in getattr(one, "replays", None) or ())
        for row in _blocks(dataset)
        for one in row
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
                f"({', '.join(urls[:3])}) hold {total}: " + _WRITE_IT
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
        and of the files' names and record batches' rows: the same dataset saved again in
        other files (``save_to_disk(num_shards=...)``) keeps ``datasets``' fingerprint, but its
        epochs, dealt by record batch, are others, and a state of one does not resume the
        other."""
        digest = hashlib.sha256()
        for kind in self.kinds:
            digest.update(f"{kind.name}\0{kind.kind}\0{kind.type}\n".encode())
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

    def _image_base(self, url: str) -> str:
        """Where a relative image ``path`` is: the working directory the dataset was given in,
        where ``datasets`` opens it from (not the Arrow file's directory, in its cache)."""
        return self.arrow_plan.arrow.base or super()._image_base(url)

    def _read_unit(self, unit: int, epoch: int | None, rows: tuple[int, int] | None = None) -> Any:
        """Record batch ``unit``, whole (a view of the mapping: ``rows`` saves nothing)."""
        pa, _pq = pyarrow_modules()
        plan = self.arrow_plan
        batch = plan.batches[int(plan.files[unit])][int(plan.groups[unit])]
        with self._lock:
            self.bytes_read += int(plan.ends[unit])
        return Held(0, batch.num_rows, values_of(plan.kinds, pa.Table.from_batches([batch])))
