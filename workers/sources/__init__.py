"""The data sources: what a worker reads, sample by sample, and in which order. Runs in the
worker (and, for the planning arithmetic, in the trainer).

One family over one planning core:

* ``_positions`` (layouts, positions, the batches a shard owes) and ``_epoch_order`` (an epoch's
  seeded order): pure arithmetic, no DALI, no I/O; the trainer uses them too.
* ``_sampling``: ``BatchedSamples`` (full batches of a shard, padding flagged, a saved position
  resumed) over any ``load(index)``.
* ``_files`` (files and ImageFolders, with ``_folder_index``), ``_tars`` (tar shards, with the
  tar index, summary, writer and indexer modules ``_tar_*``, ``_wds_idx``).
* ``_datasets``: the dataset definitions ``FilesDataset``, ``TarsDataset``, ``SamplesDataset``
  (what the Loader and a mixture take; their base, ``Definition``, is what the worker opens);
  ``_mix`` (``MixDataset``, ``sharded_mix``); ``_sharded``: ``sharded_source``,
  ``sharded_files``, ``sharded_tars``, thin wrappers over a dataset definition for hand-written
  sources. Each module imports only those listed before it (no import circle).
* ``_storage`` (local ``pread`` or fsspec, identities, retries) and ``_index_file`` (mapped index
  files): the one storage layer they share.
* ``_control``: the worker's control state a ``sharded_source``/``sharded_files`` root is bound
  with (``on_error``, the samples known to fail, the batches in flight), made by the worker.

May import: ``ipc``, the standard library, numpy, and from ``workers`` only :mod:`workers.spec`
(the shard, an error's context) and :mod:`workers.startup` (the storage backends a script
opens). Never ``loader``, and never DALI: not :mod:`workers.dali`, not :mod:`workers.transport`,
not ``nvidia.dali`` (a test forbids them, type-only imports included): the batches are numpy,
and the worker's capture layer (:mod:`workers.capture`) puts them under DALI. The public names
below are re-exported by ``workers`` (and ``loader``); the worker's command loop takes the
control state, :class:`Definition` and :class:`BatchedSamples` from here.
"""

from ._control import (
    REPORT_PROGRESS,
    SKIP_DAMAGED,
    STARTED_TOGETHER,
    FeedState,
    SampleControl,
)
from ._datasets import Definition, FilesDataset, SamplesDataset, TarsDataset
from ._files import list_files
from ._image_size import MAX_IMAGE_PIXELS, ImageTooLargeError
from ._mix import MixDataset, sharded_mix
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
from ._sharded import sharded_files, sharded_source, sharded_tars
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
    "Definition",
    "FeedState",
    "FilesDataset",
    "ImageTooLargeError",
    "IndexProgress",
    "MixDataset",
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
