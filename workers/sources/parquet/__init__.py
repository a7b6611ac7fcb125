"""The Parquet source: ``sharded_parquet`` and ``ParquetDataset`` read Parquet files (those of the
Hugging Face Hub and of ``datasets``) with every guarantee of the other sources. Runs in the
worker.

* ``_arrow``: pyarrow, imported only here and only when a Parquet dataset is opened (the
  ``[parquet]`` extra; ``import loader`` never imports it).
* ``_columns``: what each requested column becomes (Hugging Face's ``Image``, binary, integers,
  floats, strings, lists of numbers), checked at the start; values as views of Arrow's buffers.
* ``_plan``: the files listed and their footers read (one ranged read each): the row groups,
  the unit an epoch's order deals, each with the byte range of the requested columns.
* ``_schemas``: the requested columns' kinds, agreeing across files, and the leaf columns
  (column chunks) that hold them.
* ``_footers``: footers read once per node (remote ones kept in the node's cache).
* ``_reader``: ``load(index)``: a row group read with one ranged read, ahead of its need.
* ``_sparse``: what pyarrow reads a row group from (the ranges read, as views), and the record
  batches a large row group is read in.
* ``_summary``: the summary of a directory of Parquet files (``loader-parquet-summary.json``),
  read at a start in place of the listing and the footers.
* ``_index``: what the index command runs for Parquet files: footers read on threads, the
  summary written beside them.
* ``_ipc``: a ``datasets.Dataset``'s memory-mapped Arrow files, read where they lie.

:func:`open_parquet_source` opens one for a shard: the plan, the loader and the epoch orders
(the row groups permuted, then the rows inside a window of row groups, as tar shards are:
:class:`~workers.sources.tars.TarOrders`).

May import: the standard library, numpy, pyarrow (inside functions, through ``_arrow``),
:mod:`workers.spec` and the other wings through their faces (:mod:`~workers.sources.plan`,
:mod:`~workers.sources.storage`, :mod:`~workers.sources.files`, :mod:`~workers.sources.tars`).
Never DALI, never ``loader``.
"""

from ._arrow import EXTRA_HINT
from ._index import ParquetProgress, index_parquet, names_parquet
from ._ipc import ArrowFiles, arrow_files_of
from ._open import WINDOW_BYTES, open_parquet_source

__all__ = [
    "EXTRA_HINT",
    "WINDOW_BYTES",
    "ArrowFiles",
    "ParquetProgress",
    "arrow_files_of",
    "index_parquet",
    "names_parquet",
    "open_parquet_source",
]
