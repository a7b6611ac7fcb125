"""The data sources: what a worker reads, sample by sample, and in which order. Runs in the
worker (and, for the planning arithmetic, in the trainer).

One family over one planning core:

* ``_positions`` (layouts, positions, the batches a shard owes) and ``_epoch_order`` (an epoch's
  seeded order): pure arithmetic, no DALI, no I/O; the trainer uses them too.
* ``_sampling``: ``BatchedSamples`` (full batches of a shard, padding flagged, a saved position
  resumed) over any ``load(index)``.
* ``_files`` (files and ImageFolders, with ``_folder_index``), ``_tars`` (tar shards, with the
  tar index, summary, writer and indexer modules ``_tar_*``, ``_wds_idx``).
* ``parquet/``: Parquet files (``ParquetDataset``, ``sharded_parquet``): the plan from the
  footers, row groups read by ranged reads (pyarrow, imported only when one is opened).
* ``_datasets``: the dataset definitions ``FilesDataset``, ``TarsDataset``, ``ParquetDataset``,
  ``SamplesDataset`` (what a mixture takes); ``_mix`` (``sharded_mix``); ``_sharded``:
  ``sharded_source``, ``sharded_files``, ``sharded_tars``, ``sharded_parquet``, one call each
  over a dataset definition. Each module imports
  only those listed before it (no import circle).
* ``_storage`` (local ``pread`` or fsspec, identities, retries) and ``_index_file`` (mapped index
  files): the one storage layer they share.
* ``_control``: the worker's control state a ``sharded_source``/``sharded_files`` root is bound
  with (``on_error``, the samples known to fail, the batches in flight), made by the worker.

May import: ``ipc``, the standard library, numpy, and from ``workers`` only :mod:`workers.spec`,
:mod:`workers.transport` (an error's context), :mod:`workers.startup` (the storage backends a
script opens) and, inside functions, :mod:`workers.dali` (what a source needs of its worker).
Never ``loader``. The public names below are re-exported by ``workers`` (and ``loader``); the
worker's command loop (:mod:`workers.capture`) takes the control state and
:class:`BatchedSamples` from here.
"""

from ._control import (
    REPORT_PROGRESS,
    SKIP_DAMAGED,
    STARTED_TOGETHER,
    FeedState,
    SampleControl,
)
from ._datasets import FilesDataset, ParquetDataset, SamplesDataset, TarsDataset
from ._files import list_files
from ._image_size import MAX_IMAGE_PIXELS, ImageTooLargeError
from ._mix import sharded_mix
from ._parts import describe_difference
from ._positions import (
    continue_from,
    every_shard_steps,
    plan_epoch,
    shard_batches,
    shard_indices,
    shard_steps,
    steps_left,
    steps_per_epoch,
)
from ._sampling import BatchedSamples
from ._sharded import sharded_files, sharded_parquet, sharded_source, sharded_tars
from ._storage import StorageFailure
from ._tar_tool import Progress as IndexProgress
from ._tar_tool import index_dataset
from ._tars import write_tars

__all__ = [
    "MAX_IMAGE_PIXELS",
    "REPORT_PROGRESS",
    "SKIP_DAMAGED",
    "STARTED_TOGETHER",
    "BatchedSamples",
    "FeedState",
    "FilesDataset",
    "ImageTooLargeError",
    "IndexProgress",
    "ParquetDataset",
    "SampleControl",
    "SamplesDataset",
    "StorageFailure",
    "TarsDataset",
    "continue_from",
    "describe_difference",
    "every_shard_steps",
    "index_dataset",
    "list_files",
    "plan_epoch",
    "shard_batches",
    "shard_indices",
    "shard_steps",
    "sharded_files",
    "sharded_mix",
    "sharded_parquet",
    "sharded_source",
    "sharded_tars",
    "steps_left",
    "steps_per_epoch",
    "write_tars",
]
