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
* ``_datasets``: the dataset definitions ``FilesDataset``, ``TarsDataset``, ``SamplesDataset``
  (what a mixture takes); ``_mix`` (``sharded_mix``); ``_sharded``: ``sharded_source``,
  ``sharded_files``, ``sharded_tars``, one call each over a dataset definition.

Imports between wings go down that list and through a wing's face, never to another wing's
private module: ``plan`` imports no other wing, ``storage`` only ``plan``, ``files`` those two,
``tars`` those three, and the modules at this level any wing. No import circle.

May import: ``ipc``, the standard library, numpy, and from ``workers`` only :mod:`workers.spec`,
:mod:`workers.transport` (an error's context), :mod:`workers.startup` (the storage backends a
script opens) and, inside functions, :mod:`workers.dali` (what a source needs of its worker).
Never ``loader``. The public names below are re-exported by ``workers`` (and ``loader``); the
worker's command loop (:mod:`workers.capture`) takes the control state and
:class:`BatchedSamples` from here.
"""

from ._datasets import FilesDataset, SamplesDataset, TarsDataset
from ._mix import sharded_mix
from ._sharded import sharded_files, sharded_source, sharded_tars
from .files import MAX_IMAGE_PIXELS, ImageTooLargeError, list_files
from .plan import (
    REPORT_PROGRESS,
    SKIP_DAMAGED,
    STARTED_TOGETHER,
    BatchedSamples,
    FeedState,
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
from .storage import StorageFailure
from .tars import Progress as IndexProgress
from .tars import index_dataset, write_tars

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
    "sharded_source",
    "sharded_tars",
    "steps_left",
    "steps_per_epoch",
    "write_tars",
]
