"""Worker side: the process that owns one shard's DALI source and capture loop.

Imports ``ipc`` only; never ``loader``. The process entry point is :func:`run_worker`; it imports
DALI in the child, so importing this package does not import DALI.
"""

from typing import Any

from ipc.wire import Position, Sampling

from ._entry import run_worker
from ._error_text import FAILING_SAMPLES
from ._imports import modules_of, prepare_worker_server
from ._phase import Phase
from ._shard import Shard
from ._spec import FeederFactory, SourceFactory, StepFunction, WorkerSpec
from ._timing import BatchClock
from .sources._datasets import FilesDataset, SamplesDataset, TarsDataset
from .sources._files import list_files
from .sources._image_size import MAX_IMAGE_PIXELS, ImageTooLargeError
from .sources._mix import sharded_mix
from .sources._parts import describe_difference
from .sources._positions import (
    continue_from,
    every_shard_steps,
    plan_epoch,
    shard_batches,
    shard_indices,
    shard_steps,
    steps_left,
    steps_per_epoch,
)
from .sources._sampling import BatchedSamples
from .sources._sharded import sharded_files, sharded_source, sharded_tars
from .sources._storage import StorageFailure
from .sources._tar_tool import Progress as IndexProgress
from .sources._tar_tool import index_dataset
from .sources._tars import write_tars

#: DALI-facing helpers shared with in-process measurements; importing them imports DALI.
_DALI_HELPERS = ("epoch_iterator", "make_context")


def __getattr__(name: str) -> Any:
    """``epoch_iterator``/``make_context`` of the DALI adapter, imported on first use."""
    if name in _DALI_HELPERS:
        from . import _dali

        return getattr(_dali, name)
    raise AttributeError(f"module 'workers' has no attribute {name!r}")


__all__ = [
    "FAILING_SAMPLES",
    "MAX_IMAGE_PIXELS",
    "BatchClock",
    "BatchedSamples",
    "FeederFactory",
    "FilesDataset",
    "ImageTooLargeError",
    "IndexProgress",
    "Phase",
    "Position",
    "SamplesDataset",
    "Sampling",
    "Shard",
    "SourceFactory",
    "StepFunction",
    "StorageFailure",
    "TarsDataset",
    "WorkerSpec",
    "continue_from",
    "describe_difference",
    "every_shard_steps",
    "index_dataset",
    "list_files",
    "modules_of",
    "plan_epoch",
    "prepare_worker_server",
    "run_worker",
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
