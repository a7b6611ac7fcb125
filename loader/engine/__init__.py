"""The engine: one layout's event loop and its policies.

Owns: the :class:`~loader.engine._coordinator.Coordinator` (the event loop the run drives: the
only code that raises the workers' failures or closes the pool) and its parts: the roster of
sessions, the one way records go to workers (:mod:`._roster`), the wait on every worker that
replaces a dead or stuck one (:mod:`._waiting`), record routing (:mod:`._routing`), and the
signature agreement (:mod:`._agreement`); each worker's
:class:`~loader.engine._session.WorkerSession` (one state machine), and the policies that return
decisions and never call back: order (:mod:`._order`), healing (:mod:`._healing`), releases
(:mod:`._releases`), failures (:mod:`._failures`); the batches users hold (:mod:`._views`), the
queue their finalizers fill from any thread (:mod:`._release_queue`), and the counters and
timeline that stats read (:mod:`._stats`).

May import: ``loader.errors``, :mod:`loader.config`, :mod:`loader.processes`, ``workers``,
``ipc``.
"""

from ._coordinator import Coordinator, WorkerFacts
from ._healing import Healing, Timeouts, check_healable
from ._interrupts import is_interruption
from ._session import Delivery
from ._stats import (
    STAGES,
    LoaderStats,
    StartSpan,
    Timeline,
    TrainerCounters,
    WorkerStats,
    batch_end,
)
from ._views import (
    BatchInfo,
    LoadedArray,
    LoadedBatch,
    LoadedList,
    LoadedTuple,
    build_batch,
    carry_info,
    current_stream,
    jsons,
    register_pytree_nodes,
    texts,
)

__all__ = [
    "STAGES",
    "BatchInfo",
    "Coordinator",
    "Delivery",
    "Healing",
    "LoadedArray",
    "LoadedBatch",
    "LoadedList",
    "LoadedTuple",
    "LoaderStats",
    "StartSpan",
    "Timeline",
    "Timeouts",
    "TrainerCounters",
    "WorkerFacts",
    "WorkerStats",
    "batch_end",
    "build_batch",
    "carry_info",
    "check_healable",
    "current_stream",
    "is_interruption",
    "jsons",
    "register_pytree_nodes",
    "texts",
]
