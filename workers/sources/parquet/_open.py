"""Open a Parquet dataset for one shard: check the arguments, plan from the footers, make the
loader and the epoch orders. Runs in the worker.

An epoch's order (``shuffle=True``) permutes the row groups by the seed and the epoch, cuts that
sequence where each worker's part starts and ends, cuts each part into windows of
``shuffle_window`` row groups and permutes the rows inside each window
(:class:`~workers.sources.tars.TarOrder`, which deals tar shards the same way): a worker reads
of each row group only its own piece's, each once, and holds one window's row groups at a time.
``shuffle_window=None``: for local files, as many row groups as take :data:`WINDOW_BYTES` of the
requested columns (their median size), at least one -- ``datasets`` >= 4.1 writes ~100 MB row
groups, so one; the Hub's 100-row ones, many. For remote files, one row group: a resume then
re-reads at most one row group per worker (the one it was partly through).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ...spec import Shard
from ..files import MAX_IMAGE_PIXELS, checked_limit
from ..plan import OpenedSource
from ..storage import AHEAD_BYTES, RETRIES
from ..tars import TarOrders
from ._ipc import ArrowFiles, ArrowLoader, ArrowPlan
from ._plan import ParquetPlan, open_plan_once
from ._reader import ParquetLoader

__all__ = ["WINDOW_BYTES", "checked_columns", "open_parquet_source"]

#: Bytes of row groups (of the requested columns) an epoch shuffles together by default.
WINDOW_BYTES = 64 << 20


def checked_columns(columns: str | Sequence[str]) -> tuple[str, ...]:
    """``columns`` as a tuple of names; ``ValueError`` when it names none or repeats one."""
    names = (columns,) if isinstance(columns, str) else tuple(columns)
    if not names or not all(isinstance(name, str) and name for name in names):
        raise ValueError(
            f"columns must name at least one column, e.g. ('image', 'label'), got {columns!r}"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"columns names a column twice: {names}")
    return names


def default_window(begins: np.ndarray[Any, Any], ends: np.ndarray[Any, Any]) -> int:
    """Row groups whose median bytes make :data:`WINDOW_BYTES` (at least 1)."""
    median = max(1, int(np.median(ends - begins)))
    return max(1, WINDOW_BYTES // median)


def open_parquet_source(
    shard: Shard,
    urls: str | os.PathLike[str] | Sequence[str] | ArrowFiles,
    *,
    columns: str | Sequence[str] = ("image", "label"),
    storage_options: dict[str, Any] | None = None,
    shuffle_window: int | None = None,
    ahead: int = 2,
    ahead_bytes: int | None = AHEAD_BYTES,
    retries: int = RETRIES,
    seed: int = 0,
    shuffle: bool = True,
    max_image_pixels: int | None = MAX_IMAGE_PIXELS,
    optional: Mapping[str, Any] | None = None,
    page_index: bool = True,
) -> OpenedSource:
    """The opened source of ``shard``'s part of the Parquet files ``urls``; ``optional``: the
    columns whose nulls give a default (column -> default), counted in ``stats().defaulted``;
    ``page_index``: some rows of a row group read by their pages where the file has a page
    index (:mod:`._pages`)."""
    names = checked_columns(columns)
    max_pixels = checked_limit(max_image_pixels)
    checked = [("retries", retries, 0), ("ahead", ahead, 0)]
    if ahead_bytes is not None:
        checked.append(("ahead_bytes", ahead_bytes, 0))
    if shuffle_window is not None:
        checked.append(("shuffle_window", shuffle_window, 1))
    for name, value, low in checked:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if not isinstance(page_index, bool):
        raise TypeError(f"page_index must be True or False, got {page_index!r}")
    load: ParquetLoader
    if isinstance(urls, ArrowFiles):
        arrow = ArrowPlan(urls, names)
        plan: ParquetPlan = arrow
        load = ArrowLoader(arrow, max_pixels, optional)
    else:
        plan = open_plan_once(urls, names, storage_options, retries)
        load = ParquetLoader(plan, ahead, ahead_bytes, max_pixels, optional, page_index)
    units = len(plan.counts)
    if shuffle_window is not None:
        window = shuffle_window
    elif plan.storage.local:
        window = default_window(plan.begins, plan.ends)
    else:
        window = 1
    window = min(window, units)
    fingerprint = plan.fingerprint()
    orders = None
    if shuffle:
        fingerprint += f"+window{window}"
        orders = TarOrders(plan, seed, window)  # type: ignore[arg-type]
    return OpenedSource(
        plan.total,
        load,
        len(names),
        fingerprint,
        names,
        orders,
        load.describe,
        parts=plan.parts(),
        left_out=plan.left_out(),
    )
