"""Worker side: the process that owns one shard's DALI source and capture loop.

Imports ``ipc`` only; never ``loader``.
"""

from ._main import Worker, run_worker
from ._sampling import BatchedSamples, shard_indices, sharded_source, steps_per_epoch
from ._shard import Shard
from ._spec import FeederFactory, SourceFactory, StepFunction, WorkerSpec

__all__ = [
    "BatchedSamples",
    "FeederFactory",
    "Shard",
    "SourceFactory",
    "StepFunction",
    "Worker",
    "WorkerSpec",
    "run_worker",
    "shard_indices",
    "sharded_source",
    "steps_per_epoch",
]
