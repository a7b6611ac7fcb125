"""Worker side: the process that owns one shard's DALI source and capture loop. This module is
the package's public face: ``loader`` imports from here (and starts :mod:`workers.server`).

Imports ``ipc`` only; never ``loader``. The process's one entry point is :func:`run_worker`
(:mod:`workers.process`); it imports DALI in the child, so importing this package does not
import DALI.

The package, by job (each sub-package's ``__init__`` says what it owns and may import):

* :mod:`workers.process` -- the worker process: its entry point, set-up, title, DALI's import.
* :mod:`workers.capture` -- on the worker's main thread: the command loop and the capture loops.
* :mod:`workers.transport` -- what goes to the trainer: batches into slots, signatures, stage
  times, failure records.
* :mod:`workers.sources` -- the data sources and the planning arithmetic (the trainer's too).
* :mod:`workers.startup` -- a start's spans, and what is kept on disk for the next start.
* :mod:`workers.server` -- the worker server's process, which forks workers.
* :mod:`workers.spec` -- what the trainer tells a worker: its shard and its spec.
* :mod:`workers.dali` -- the one adapter to DALI's capture API.

Bottom first, each imports only those before it: ``spec``, ``dali``, ``startup``,
``transport``, ``sources``, ``capture``, ``process``, ``server``; ``sources`` imports neither
``dali`` nor ``transport`` (the data code knows nothing of DALI: the capture layer puts its
batches under DALI), and ``dali`` imports nothing of ``sources``.
"""

from typing import Any

from ipc.wire import Position, Sampling

from .capture import Phase
from .process import modules_of, prepare_worker_server, run_worker
from .sources import (
    MAX_IMAGE_PIXELS,
    BatchedSamples,
    Definition,
    FilesDataset,
    ImageTooLargeError,
    IndexProgress,
    MixDataset,
    ParquetDataset,
    ParquetProgress,
    SamplesDataset,
    StorageFailure,
    StorageLibraryError,
    TarsDataset,
    check_storage_libraries,
    continue_from,
    describe_difference,
    every_shard_steps,
    index_dataset,
    index_parquet,
    list_files,
    names_parquet,
    plan_epoch,
    shard_batches,
    shard_indices,
    shard_steps,
    sharded_files,
    sharded_mix,
    sharded_parquet,
    sharded_source,
    sharded_tars,
    steps_left,
    steps_per_epoch,
    write_tars,
)
from .spec import FeederFactory, Shard, SourceFactory, StepFunction, WorkerSpec
from .transport import FAILING_SAMPLES, BatchClock

#: DALI-facing helpers shared with in-process measurements; importing them imports DALI.
_DALI_HELPERS = ("epoch_iterator", "make_context")


def __getattr__(name: str) -> Any:
    """``epoch_iterator``/``make_context`` of the DALI adapter, imported on first use."""
    if name in _DALI_HELPERS:
        from . import dali

        return getattr(dali, name)
    raise AttributeError(f"module 'workers' has no attribute {name!r}")


__all__ = [
    "FAILING_SAMPLES",
    "MAX_IMAGE_PIXELS",
    "BatchClock",
    "BatchedSamples",
    "Definition",
    "FeederFactory",
    "FilesDataset",
    "ImageTooLargeError",
    "IndexProgress",
    "MixDataset",
    "ParquetDataset",
    "ParquetProgress",
    "Phase",
    "Position",
    "SamplesDataset",
    "Sampling",
    "Shard",
    "SourceFactory",
    "StepFunction",
    "StorageFailure",
    "StorageLibraryError",
    "TarsDataset",
    "WorkerSpec",
    "check_storage_libraries",
    "continue_from",
    "describe_difference",
    "every_shard_steps",
    "index_dataset",
    "index_parquet",
    "list_files",
    "modules_of",
    "names_parquet",
    "plan_epoch",
    "prepare_worker_server",
    "run_worker",
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
