"""The worker process's entry point, importable without DALI (the trainer pickles it by name)."""

from __future__ import annotations

from multiprocessing.connection import Connection

from ._spec import WorkerSpec


def run_worker(spec: WorkerSpec, conn: Connection, stack: Connection, alive: Connection) -> None:
    """Start a worker: imports DALI here, in the child, never in the trainer (without torch on
    the way: :mod:`workers._imports`)."""
    from ._imports import import_dali_modules

    import_dali_modules()
    from ._main import run_worker as serve

    serve(spec, conn, stack, alive)
