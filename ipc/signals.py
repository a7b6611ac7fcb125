"""The signals of the loader's processes: those a cluster sends to the whole job, which belong
to the trainer, and the two a trainer sends to its own workers.

A cluster manager stops or preempts a job with a signal to every process of it (SLURM's
``scancel`` and time limit send SIGTERM, ``--signal`` SIGUSR1 or SIGUSR2 ahead of it; a terminal's
Ctrl-C is SIGINT to the foreground group). Those are the trainer's to handle: it may finish its
step, save and exit, and it needs its workers for that. So the worker server and the workers
ignore :data:`TRAINERS_SIGNALS` while their trainer lives; they still end with it (the liveness
pipe, and the parent-death signal where the trainer is the parent), and a trainer that does not
handle the signal dies of it as it would, its workers after it.

A process of the loader starts with those signals blocked (:func:`blocked_for_start` around its
fork or spawn in the trainer) and ignores them before it unblocks them (:func:`leave_to_trainer`),
so a Ctrl-C while it starts (its interpreter, its imports) neither kills it with a traceback nor
is lost to the trainer, which receives it as the block ends.

The trainer reaches its own workers with signals no cluster sends:

* :data:`STACK_SIGNAL`: write every thread's stack to the stack pipe (faulthandler), then the
  sample a ``load`` is stuck on (``wire.LoadRunning``); sent when a worker sent nothing for too
  long.
* :data:`STOP_SIGNAL`: end now (the default action of a real-time signal); sent by the pool's
  close to a worker that did not stop when asked, before SIGKILL.

Linux only, as the rest of the transport.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

#: What a job's processes receive from a cluster manager or a terminal: the trainer's to handle.
TRAINERS_SIGNALS: tuple[signal.Signals, ...] = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)

#: The trainer asks a worker for its stack.
STACK_SIGNAL: int = signal.SIGRTMIN + 3
#: The trainer stops a worker that did not stop when asked.
STOP_SIGNAL: int = signal.SIGRTMIN + 4


def leave_to_trainer() -> None:
    """Ignore :data:`TRAINERS_SIGNALS` in this process (a worker server or a worker), then
    unblock them (one that arrived while they were blocked since the start is dropped), and
    take :data:`STOP_SIGNAL` back to its default action (terminate)."""
    for signum in TRAINERS_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, TRAINERS_SIGNALS)
    with contextlib.suppress(OSError, ValueError):
        signal.signal(STOP_SIGNAL, signal.SIG_DFL)


@contextlib.contextmanager
def blocked_for_start() -> Iterator[None]:
    """Around the fork or spawn of a worker server or worker in the trainer: block
    :data:`TRAINERS_SIGNALS` in this thread, which the child inherits (through ``exec`` too)
    until its :func:`leave_to_trainer`. Here the block only defers them: one that arrives
    meanwhile is delivered when the previous mask comes back."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, TRAINERS_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
