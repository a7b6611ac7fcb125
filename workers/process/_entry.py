"""The worker process's one entry point, importable without DALI (the trainer pickles it by name).

Runs in the worker: a spawned child, or a child the worker server forked (:mod:`workers.server`).
:func:`run_worker` imports DALI, then hands the process to :func:`workers.process._setup.serve`.
"""

from __future__ import annotations

import contextlib
import os
from multiprocessing.connection import Connection

from ipc.signals import leave_to_trainer

from .. import startup
from ..spec import WorkerSpec


def run_worker(
    spec: WorkerSpec,
    conn: Connection,
    stack: Connection,
    alive: Connection,
    environ: dict[str, str] | None = None,
) -> None:
    """Start a worker: imports DALI here, in the child, never in the trainer (without torch on
    the way: :mod:`workers.process._imports`). A worker forked from a server that imported DALI
    already gets ``environ``, the trainer's environment when it was started, in place of the
    server's."""
    leave_to_trainer()  # first: a cluster's signal to the job during the imports is the trainer's
    spawned = startup.started_ns() is None  # (a forked worker's start was noted at its fork)
    if spawned:
        startup.process_started()
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    from ._imports import import_dali_modules, warm_spawned_worker

    with startup.span("import DALI") if spawned else contextlib.nullcontext():
        import_dali_modules()
    if environ is None:  # (spawned: the server's parsing did not happen for this worker)
        with startup.span("DALI's source analysis") if spawned else contextlib.nullcontext():
            warm_spawned_worker(spec.source, spec.step, spec.feeders)
    from ._setup import serve

    serve(spec, conn, stack, alive)
