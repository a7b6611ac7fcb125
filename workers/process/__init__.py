"""The worker process: its one entry point, the process set-up around its command loop, its
title, and importing DALI without PyTorch. Runs in the worker (a spawned child, or one the worker
server forked) and, for the imports and the title, in the worker server; never in the trainer,
which only names :func:`run_worker` (pickled by name) and calls :func:`modules_of`.

The entry point is :func:`run_worker` (:mod:`._entry`), importable without DALI. It imports DALI
(:mod:`._imports`), then hands the process to :mod:`._setup`: faulthandler, the parent-death
signal, logging routed to the trainer, the title (:mod:`._title`), and the trainer's commands
served by one :class:`workers.capture.Worker`.

May import: ``ipc``, :mod:`workers.spec`, :mod:`workers.startup`, and :mod:`workers.capture`
(only in :mod:`._setup`, which :func:`run_worker` imports once DALI is).
"""

from ._entry import run_worker
from ._imports import modules_of, prepare_worker_server, warm_source_analysis
from ._title import server_title, set_title, worker_title

__all__ = [
    "modules_of",
    "prepare_worker_server",
    "run_worker",
    "server_title",
    "set_title",
    "warm_source_analysis",
    "worker_title",
]
