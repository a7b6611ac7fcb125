"""The worker's command loop and its capture loops: what runs on a worker's main thread once the
process is set up (:mod:`workers.process`). Runs in the worker only.

Owns: :class:`Worker` (:mod:`._loop`: the trainer's commands, each epoch's steps), what the worker
is doing and its epoch's state machine (:mod:`._phase`: :class:`Phase`), the capture loops
(:mod:`._capture_loops`), building and probing one shard's source and feeders (:mod:`._sources`),
the random generators each batch carries (:mod:`._random`), and the search of a failed batch for
the samples that fail alone (:mod:`._isolation`, with what native code prints meanwhile:
:mod:`._stderr`), and DALI's log lines on the process's stderr, held until their batch's outcome
is known (:mod:`._native_lines`). Every call into DALI goes through :mod:`workers.dali`.

The command loop imports DALI: :class:`Worker`, :class:`Stop` and :class:`ShutdownRequested` are
imported on first use, so that importing ``workers`` (the trainer does) imports no DALI.

May import: ``ipc``, :mod:`workers.dali`, :mod:`workers.spec`,
:mod:`workers.startup`, :mod:`workers.sources`, :mod:`workers.transport`. Not
:mod:`workers.process` (it runs this).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._phase import Phase

if TYPE_CHECKING:
    from ._loop import ShutdownRequested, Stop, Worker


def __getattr__(name: str) -> Any:
    """The command loop's names, imported on first use (its module imports DALI)."""
    if name in ("ShutdownRequested", "Stop", "Worker"):
        from . import _loop

        return getattr(_loop, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Phase", "ShutdownRequested", "Stop", "Worker"]
