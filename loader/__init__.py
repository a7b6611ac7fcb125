"""dali-capture-loader: a multiprocess sharded loader over NVIDIA DALI capture mode.

Runs in the trainer. Everything public is re-exported here; other modules are private. The
trainer side is in layers, each a sub-package that imports only those below it (a test checks
the direction and that no import circle exists)::

    cli/         the command line: python -m loader [doctor]      (prints)
    ---------    the public face: Loader (_loader), ndd (_ndd), sample, tars, testing, hf, errors
    run/         the run's lifecycle: Run, layout plan, launcher, epochs, checkpoint, ranks
    observe/     trace, diagnose, advice (reads the engine's snapshots)
    engine/      coordinator (waiting, routing, roster, agreement), sessions, order,
                 healing, failures, releases, views, stats
    processes/   the pool, the worker server
    config/      settings, autotune policy, environment, validation, torch.distributed

``run`` and ``observe`` are siblings: neither imports the other.
"""

import gc as _gc

# The garbage collector waits while the package imports: its imports make objects by the ten
# thousand, and each few hundred would set off a collection, one of them over every object the
# script made before (torch's, when it came first: ~0.08 s of the trainer's start, and the
# worker server, forked at the end, starts that much later). It runs again afterwards if it did.
_collecting = _gc.isenabled()
_gc.disable()
try:
    from workers import (
        BatchedSamples,
        FilesDataset,
        ImageTooLargeError,
        MixDataset,
        ParquetDataset,
        SamplesDataset,
        Shard,
        StorageFailure,
        StorageLibraryError,
        TarsDataset,
        shard_indices,
        shard_steps,
        sharded_files,
        sharded_mix,
        sharded_parquet,
        sharded_source,
        sharded_tars,
        steps_per_epoch,
        write_tars,
    )

    from ._loader import OPEN_LOADERS as OPEN_LOADERS  # (for the leak_check fixture)
    from ._loader import Loader, LoaderStats, WorkerStats
    from ._ndd import ndd
    from .config import LoaderConfig, package_version
    from .engine import (
        BatchInfo,
        LoadedArray,
        LoadedBatch,
        LoadedList,
        LoadedTuple,
        Timeline,
        jsons,
        texts,
    )
    from .errors import (
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
    from .processes.server import server_pid as worker_server_pid
    from .processes.server import shutdown as shutdown_worker_server
    from .sample import ensure_sample_dataset, list_images

    __version__ = package_version()
finally:
    if _collecting:
        _gc.enable()
    del _collecting

__all__ = [
    "AgreementError",
    "BatchInfo",
    "BatchedSamples",
    "FilesDataset",
    "ImageTooLargeError",
    "LoadedArray",
    "LoadedBatch",
    "LoadedList",
    "LoadedTuple",
    "Loader",
    "LoaderClosedError",
    "LoaderConfig",
    "LoaderError",
    "LoaderStats",
    "MixDataset",
    "ParquetDataset",
    "RemoteTraceback",
    "SamplesDataset",
    "Shard",
    "SharedMemoryError",
    "SkipLimitError",
    "SlotsExhaustedError",
    "StartupError",
    "StorageFailure",
    "StorageLibraryError",
    "TarsDataset",
    "Timeline",
    "WorkerDiedError",
    "WorkerError",
    "WorkerStats",
    "WorkerTimeoutError",
    "__version__",
    "ensure_sample_dataset",
    "jsons",
    "list_images",
    "ndd",
    "shard_indices",
    "shard_steps",
    "sharded_files",
    "sharded_mix",
    "sharded_parquet",
    "sharded_source",
    "sharded_tars",
    "shutdown_worker_server",
    "steps_per_epoch",
    "texts",
    "worker_server_pid",
    "write_tars",
]


def _start_server_early() -> None:
    """The worker server starts now, in the background, where that is safe and wanted
    (:func:`loader.processes.server.start_early`): a failure here is the first loader's."""
    import logging

    from .processes.server import start_early

    try:
        start_early()
    except Exception:
        logging.getLogger("loader").debug("the worker server did not start early", exc_info=True)


_start_server_early()
