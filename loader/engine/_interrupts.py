"""Interruptions: an exception that a signal handler raised in the trainer's thread while the
loader's own code ran (``KeyboardInterrupt`` from Ctrl-C's SIGINT, ``SystemExit`` from a handler
that exits), told apart from a failure of the loader or of its workers. Runs in the trainer.

Python raises it wherever the thread is, and the loader lets it through unchanged. What is left
behind depends on where it landed:

* **blocked in a wait for a batch** (nothing of what the workers sent was being handled): every
  worker's session is as it was, so nothing stops. The iterator can go on (the same batch is
  waited for again), ``state_dict()`` describes the batches handed out, and the next ``iter()``
  leaves the epoch as after a ``break``.
* **anywhere else** (a record half-handled, a command half-sent, a batch half-built for the
  user): the workers are stopped, as for a failure, and a batch that was being handed out is
  not counted. ``state_dict()`` still describes the batches handed out; iterating raises
  ``LoaderClosedError`` with the words of :func:`reason`.

The waits tell the first case (:attr:`loader.engine._waiting.Waiter.blocked`); the coordinator
and the run decide (:meth:`loader.engine._coordinator.Coordinator.interrupted_cleanly`).
"""

from __future__ import annotations


def is_interruption(error: BaseException) -> bool:
    """True for what a signal handler raises to stop the program (``KeyboardInterrupt``,
    ``SystemExit``: not an ``Exception``), False for a failure."""
    return not isinstance(error, Exception)


def reason(error: BaseException, doing: str) -> str:
    """Why the workers stopped, never empty: a failure's own message (its type when it has
    none); for an interruption, its type and what the loader was ``doing``."""
    text = str(error)
    if not is_interruption(error):
        return text or type(error).__name__
    name = type(error).__name__ + (f" ({text})" if text else "")
    return f"interrupted by {name} while {doing or 'the loader was busy'}"
