"""What the trainer tells a worker: its place among all workers (:class:`Shard`, :mod:`._shard`)
and everything else it needs at spawn time (:class:`WorkerSpec`, :mod:`._spec`, with the types of
the user's functions). Runs in both processes: the trainer makes them, the worker receives them
pickled. Besides, for the worker alone, the one note an error carries across its layers
(:class:`ErrorContext`, :mod:`._error_context`): the sources write it, the transport reads it.

May import: ``ipc``. Nothing else of ``workers``: every other part of it imports this.
"""

from ._error_context import ErrorContext, attach, context_of
from ._shard import Shard
from ._spec import FeederFactory, SourceFactory, StepFunction, WorkerSpec

__all__ = [
    "ErrorContext",
    "FeederFactory",
    "Shard",
    "SourceFactory",
    "StepFunction",
    "WorkerSpec",
    "attach",
    "context_of",
]
