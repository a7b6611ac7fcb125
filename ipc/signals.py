"""The signals of the loader's processes: those a cluster sends to the whole job, which belong
to the trainer, and the two a trainer sends to its own workers.

A cluster manager stops or preempts a job with a signal to every process of it (SLURM's
``scancel`` and time limit send SIGTERM, ``--signal`` SIGUSR1 or SIGUSR2 ahead of it; a terminal's
Ctrl-C is SIGINT to the foreground group). Those are the trainer's to handle: it may finish its
step, save and exit, and it needs its workers for that. So the worker server and the workers
ignore :data:`TRAINERS_SIGNALS` while their trainer lives; they still end with it (the liveness
pipe, and the parent-death signal where the trainer is the parent), and a trainer that does not
handle the signal dies of it as it would, its workers after it.

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
    """Ignore :data:`TRAINERS_SIGNALS` in this process (a worker server or a worker), and take
    :data:`STOP_SIGNAL` back to its default action (terminate)."""
    for signum in TRAINERS_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    with contextlib.suppress(OSError, ValueError):
        signal.signal(STOP_SIGNAL, signal.SIG_DFL)
