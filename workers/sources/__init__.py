"""The data sources: what a worker reads, sample by sample, and in which order. Runs in the
worker (and, for the planning arithmetic, in the trainer).

A face over its wings, each a sub-package with a face of its own, bottom up:

* :mod:`~workers.sources.plan`: the planning arithmetic (positions, an epoch's order, the parts a
  state records, the worker's control state, :class:`BatchedSamples` over any ``load(index)``):
  no DALI, no I/O; the trainer uses it too, through its face.
* :mod:`~workers.sources.storage`: the bytes (local ``pread`` or fsspec, identities, retries,
  :class:`StorageFailure`) and the mapped index files every format keeps.
* :mod:`~workers.sources.files`: files and ImageFolders (with their folder index), and the
  image-size guard every format applies.
* :mod:`~workers.sources.tars`: the WebDataset tar format (reader, order, fetch, shards,
  listing, walk, index, summary; the writer and the index command apart, offline).
* :mod:`~workers.sources.parquet`: Parquet files (the plan from the footers, row groups read by
  ranged reads; pyarrow, imported only when one is opened).
* ``_datasets``: the dataset definitions ``FilesDataset``, ``TarsDataset``, ``ParquetDataset``,
  ``SamplesDataset`` (what the Loader and a mixture take; their base, ``Definition``, is what
  the worker opens);
  ``_mix`` (``MixDataset``, ``sharded_mix``); ``_sharded``: ``sharded_source``,
  ``sharded_files``, ``sharded_tars``, ``sharded_parquet``, thin wrappers over a dataset
  definition for hand-written sources.

Imports between wings go down that list and through a wing's face, never to another wing's
private module: ``plan`` imports no other wing, ``storage`` only ``plan``, ``files`` those two,
``tars`` those three, and the modules at this level any wing. No import circle.

May import: ``ipc``, the standard library, numpy, and from ``workers`` only :mod:`workers.spec`
(the shard, an error's context) and :mod:`workers.startup` (the storage backends a script
opens). Never ``loader``, and never DALI: not :mod:`workers.dali`, not :mod:`workers.transport`,
not ``nvidia.dali`` (a test forbids them, type-only imports included): the batches are numpy,
and the worker's capture layer (:mod:`workers.capture`) puts them under DALI. The public names
below are re-exported by ``workers`` (and ``loader``); the worker's command loop takes the
control state, :class:`Definition` and :class:`BatchedSamples` from here.
"""

from ._datasets import Definition, FilesDataset, ParquetDataset, SamplesDataset, TarsDataset
from ._mix import MixDataset, sharded_mix
from ._sharded import sharded_files, sharded_parquet, sharded_source, sharded_tars
from .files import MAX_IMAGE_PIXELS, ImageTooLargeError, list_files
from .parquet import ParquetProgress, index_parquet, names_parquet
from .plan import (
    REPORT_PROGRESS,
    SKIP_DAMAGED,
    STARTED_TOGETHER,
    BatchedSamples,
    FeedState,
    LoadSkip,
    SampleControl,
    continue_from,
    describe_difference,
    every_shard_steps,
    plan_epoch,
    shard_batches,
    shard_indices,
    shard_steps,
    steps_left,
    steps_per_epoch,
)
from .storage import StorageFailure, StorageLibraryError, check_storage_libraries, reads_so_far
from .tars import Progress as IndexProgress
from .tars import index_dataset, write_tars

__all__ = [
    "MAX_IMAGE_PIXELS",
    "REPORT_PROGRESS",
    "SKIP_DAMAGED",
    "STARTED_TOGETHER",
    "BatchedSamples",
    "Definition",
    "FeedState",
    "FilesDataset",
    "ImageTooLargeError",
    "IndexProgress",
    "LoadSkip",
    "MixDataset",
    "ParquetDataset",
    "ParquetProgress",
    "SampleControl",
    "SamplesDataset",
    "StorageFailure",
    "StorageLibraryError",
    "TarsDataset",
    "check_storage_libraries",
    "continue_from",
    "describe_difference",
    "every_shard_steps",
    "index_dataset",
    "index_parquet",
    "list_files",
    "names_parquet",
    "plan_epoch",
    "reads_so_far",
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
