"""Process setup around one :class:`~workers.capture.Worker`, once the entry point
(:func:`workers.process.run_worker`) has imported DALI.

Runs only in a worker process. :func:`serve` arms faulthandler (stacks for hangs and
crashes go to the trainer's stack pipe), the parent-death signal and a thread that exits the
process when the trainer's liveness pipe closes, routes logging and warnings to the trainer,
sends stderr through :class:`~workers.capture._native_lines.NativeLines`, and then serves the
trainer's commands (:mod:`workers.capture._loop`).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import faulthandler
import functools
import logging
import os
import signal
import sys
import threading
import warnings
from multiprocessing.connection import Connection
from typing import Any

from ipc import ChannelClosed, ControlChannel, limits, wire
from ipc.signals import STACK_SIGNAL, leave_to_trainer

from ..capture import ShutdownRequested, Stop, Worker
from ..spec import WorkerSpec
from ._title import set_title, worker_title

_PR_SET_PDEATHSIG = 1


#: Records of other threads held for the main thread to send; past this many, the oldest go.
_HELD = 256


class _Relay(logging.Handler):
    """Forwards this process's log records and warnings to the trainer. The channel is the main
    thread's: a record or a warning of another thread (a storage retry on a read-ahead thread,
    a footer read on the prefetch thread) is held, and sent by the main thread with its next
    record, after its next batch (:meth:`send_held`, the worker's ``relay_held``) and before it
    waits for a command."""

    def __init__(self, channel: ControlChannel) -> None:
        super().__init__()
        self._channel = channel
        self._owner = threading.get_ident()
        self._held: collections.deque[wire.LogRelay | wire.WarningRelay] = collections.deque(
            maxlen=_HELD
        )

    def emit(self, record: logging.LogRecord) -> None:
        self.relay(wire.LogRelay(record.levelno, record.getMessage()))

    def relay(self, message: wire.LogRelay | wire.WarningRelay) -> None:
        """Send ``message`` now (main thread: after what other threads left), else hold it."""
        if threading.get_ident() != self._owner:
            self._held.append(message)  # (deque appends are atomic)
            return
        self.send_held()
        with contextlib.suppress(ChannelClosed, OSError):
            self._channel.send(message)

    def send_held(self) -> None:
        """Send what other threads logged or warned since the last call (main thread only)."""
        if threading.get_ident() != self._owner:
            return
        while self._held:
            try:
                message = self._held.popleft()
            except IndexError:
                return
            with contextlib.suppress(ChannelClosed, OSError):
                self._channel.send(message)


def _relay_warning(
    relay: _Relay,
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: Any = None,
    line: str | None = None,
) -> None:
    """``warnings.showwarning``: the warning goes to the trainer, which shows it (one of
    another thread with the main thread's next message, see :class:`_Relay`)."""
    relay.relay(
        wire.WarningRelay(
            category.__module__, category.__qualname__, str(message), filename, lineno
        )
    )


def _watch_trainer(alive: Connection) -> None:
    """Exit the process as soon as the trainer is gone (its end of ``alive`` closes)."""
    with contextlib.suppress(EOFError, OSError):
        alive.recv_bytes()
    os._exit(0)


def _set_parent_death_signal(parent_pid: int) -> None:
    """SIGKILL this process when the trainer dies (only when the trainer is our parent:
    under forkserver the parent is the server, and the liveness pipe alone does the job)."""
    if os.getppid() != parent_pid:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:
        os._exit(0)  # the trainer died before the signal was armed


def _add_load_in_progress(worker: Worker, stack: Connection, signum: int, frame: Any) -> None:
    """After faulthandler's dump: the sample whose ``load`` runs, as one line the trainer
    parses (:class:`wire.LoadRunning`). Runs on the main thread, which waits for that load
    (a wait that signals interrupt) when a ``load`` hangs."""
    with contextlib.suppress(Exception):
        running = worker.load_in_progress()
        if running is not None:
            os.write(stack.fileno(), running.line().encode("utf-8", "replace"))


def serve(spec: WorkerSpec, conn: Connection, stack: Connection, alive: Connection) -> None:
    """Process entry point. Never returns normally: the process exits when serving ends."""
    set_title(worker_title(spec.shard.worker, spec.parent_pid))
    leave_to_trainer()  # a cluster's SIGTERM, Ctrl-C's SIGINT: the trainer's to handle
    limits.raise_oom_score(limits.WORKER_OOM_SCORE_ADJ)  # out of memory: a worker, not the trainer
    channel = ControlChannel(conn)
    worker = Worker(spec, channel)
    faulthandler.enable(file=stack.fileno(), all_threads=True)
    # STACK_SIGNAL (the trainer waited in vain): faulthandler writes every thread's stack at
    # once; chained after it, the main thread adds the sample a ``load`` is stuck on, if any
    signal.signal(STACK_SIGNAL, functools.partial(_add_load_in_progress, worker, stack))
    faulthandler.register(STACK_SIGNAL, file=stack.fileno(), all_threads=True, chain=True)
    if spec.parent_death_signal:
        _set_parent_death_signal(spec.parent_pid)
    threading.Thread(
        target=_watch_trainer, args=(alive,), daemon=True, name="trainer-watch"
    ).start()

    relay = _Relay(channel)
    logging.getLogger().handlers[:] = [relay]
    logging.getLogger().setLevel(spec.log_level)
    warnings.showwarning = functools.partial(_relay_warning, relay)
    worker.relay_with(relay.send_held)
    code = 0
    worker.native_lines.open()  # DALI's own log lines wait for their batch's outcome
    try:
        worker.start()
        worker.serve()
    except (Stop, ShutdownRequested, ChannelClosed):
        pass
    except Exception as error:
        worker.report(error)
        code = 1
    finally:
        with contextlib.suppress(Exception):
            worker.close()
        sys.stdout.flush()
        sys.stderr.flush()
        worker.native_lines.close()
    # Skip interpreter teardown: DALI's thread pools need not be joined in a process that ends.
    os._exit(code)
