"""Worker side: the process that owns one shard's DALI source and capture loop.

Imports ``ipc`` only; never ``loader``. The process entry point is ``workers._main.run_worker``;
it is not imported here, so importing the package does not import DALI.
"""

from ._sampling import BatchedSamples, shard_indices, sharded_source, steps_per_epoch
from ._shard import Shard
from ._spec import FeederFactory, SourceFactory, StepFunction, WorkerSpec

__all__ = [
    "BatchedSamples",
    "FeederFactory",
    "Shard",
    "SourceFactory",
    "StepFunction",
    "WorkerSpec",
    "shard_indices",
    "sharded_source",
    "steps_per_epoch",
]
