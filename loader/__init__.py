"""dali-capture-loader: a multiprocess sharded loader over NVIDIA DALI capture mode.

Runs in the trainer. Everything public is re-exported here; other modules are private.
"""

from workers import (
    BatchedSamples,
    FilesDataset,
    SamplesDataset,
    Shard,
    StorageFailure,
    TarsDataset,
    shard_indices,
    shard_steps,
    sharded_files,
    sharded_mix,
    sharded_source,
    sharded_tars,
    steps_per_epoch,
    write_tars,
)

from ._config import LoaderConfig
from ._errors import (
    AgreementError,
    LoaderClosedError,
    LoaderError,
    RemoteTraceback,
    SharedMemoryError,
    SkipLimitError,
    SlotsExhaustedError,
    StartupError,
    WorkerDiedError,
    WorkerError,
    WorkerTimeoutError,
)
from ._loader import Loader, LoaderStats, WorkerStats
from ._server import server_pid as worker_server_pid
from ._server import shutdown as shutdown_worker_server
from ._stats import Timeline
from ._views import BatchInfo, LoadedArray, LoadedBatch, LoadedList, LoadedTuple
from .sample import ensure_sample_dataset, list_images


def _metadata_version() -> str:
    """The installed distribution's version (``pyproject.toml`` states it, once)."""
    from importlib import metadata

    try:
        return metadata.version("dali-capture-loader")
    except metadata.PackageNotFoundError:  # a checkout on sys.path, never installed
        return "0+unknown"


__version__ = _metadata_version()

__all__ = [
    "AgreementError",
    "BatchInfo",
    "BatchedSamples",
    "FilesDataset",
    "LoadedArray",
    "LoadedBatch",
    "LoadedList",
    "LoadedTuple",
    "Loader",
    "LoaderClosedError",
    "LoaderConfig",
    "LoaderError",
    "LoaderStats",
    "RemoteTraceback",
    "SamplesDataset",
    "Shard",
    "SharedMemoryError",
    "SkipLimitError",
    "SlotsExhaustedError",
    "StartupError",
    "StorageFailure",
    "TarsDataset",
    "Timeline",
    "WorkerDiedError",
    "WorkerError",
    "WorkerStats",
    "WorkerTimeoutError",
    "__version__",
    "ensure_sample_dataset",
    "list_images",
    "shard_indices",
    "shard_steps",
    "sharded_files",
    "sharded_mix",
    "sharded_source",
    "sharded_tars",
    "shutdown_worker_server",
    "steps_per_epoch",
    "worker_server_pid",
    "write_tars",
]
