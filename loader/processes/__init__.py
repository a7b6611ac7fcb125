"""Processes: the worker pool of one layout (:mod:`._pool`: processes, sockets, arenas) and this
process's worker server (:mod:`._server`; each worker it forks is a :mod:`._server_worker`). The
only layer that starts, signals or reaps a process.

May import: ``loader.errors``, :mod:`loader.config`, ``workers`` (its entry points and the
server), ``ipc``.
"""

from . import server
from ._pool import WorkerHandle, WorkerPool, describe_exit

__all__ = [
    "WorkerHandle",
    "WorkerPool",
    "describe_exit",
    "server",
]
