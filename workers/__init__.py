"""Worker side: the process that owns one shard's DALI source and capture loop.

Imports ``ipc`` only; never ``loader``.
"""

from ._main import Worker, run_worker
from ._shard import Shard
from ._spec import FeederFactory, SourceFactory, StepFunction, WorkerSpec

__all__ = [
    "FeederFactory",
    "Shard",
    "SourceFactory",
    "StepFunction",
    "Worker",
    "WorkerSpec",
    "run_worker",
]
