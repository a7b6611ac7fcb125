"""The worker pool: starting, watching and stopping worker processes. Runs in the trainer.

A worker is forked by this process's worker server (``start_method="forkserver"``, the default:
:mod:`loader.processes.server`) or spawned by ``multiprocessing`` (``"spawn"``); either is a
:class:`WorkerProcess` to the pool and to the coordinator, which waits on its ``sentinel``.

The pool owns, per worker: the process, its control channel, its stack pipe (faulthandler output,
for hangs and crashes) and the write end of its liveness pipe (closing it makes the worker exit).
``close()`` is idempotent and releases every process and descriptor whatever happened before. It
is bounded: asking (Shutdown and the liveness pipe) gets half of ``timeout`` for the whole pool,
``ipc.signals.STOP_SIGNAL`` the other half (workers ignore a cluster's SIGTERM), and SIGKILL at
most :data:`KILL_WAIT` seconds more.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection, wait
from typing import Any, Protocol

from ipc import ChannelClosed, ControlChannel, limits, wire
from ipc.signals import STOP_SIGNAL, blocked_for_start
from workers import Definition, Shard, WorkerSpec, modules_of, run_worker

from ..config import main_file
from . import server as worker_server
from ._server_worker import ServerWorker

logger = logging.getLogger("loader")

#: How long close() waits for the kernel to reap workers after SIGKILL.
KILL_WAIT = 5.0


class WorkerProcess(Protocol):
    """What the pool and the coordinator use of a worker process: a ``multiprocessing`` process
    (spawn) or a :class:`loader.processes._server_worker.ServerWorker` (forked by the worker
    server)."""

    @property
    def pid(self) -> int | None: ...

    @property
    def sentinel(self) -> int: ...

    @property
    def exitcode(self) -> int | None: ...

    def start(self) -> None: ...

    def join(self, timeout: float | None = None) -> None: ...

    def is_alive(self) -> bool: ...

    def close(self) -> None: ...


class WorkerHandle:
    """What the pool owns of one worker: its process and the pipes to it. Nothing else: the
    worker's session state is the coordinator's (:mod:`loader.engine._session`)."""

    def __init__(
        self,
        index: int,
        spec: WorkerSpec,
        process: WorkerProcess,
        channel: ControlChannel,
        stack: Connection,
        alive: Connection,
    ) -> None:
        self.index = index
        self.spec = spec
        self.shard: Shard = spec.shard
        self.process = process
        self.channel = channel
        self.stack = stack
        self.alive = alive
        self.exited = False
        self.pid: int | None = None
        #: the kernel's out-of-memory kill counters as the worker started, to tell an OOM kill
        #: from another ``SIGKILL`` when it dies
        self.oom_kills_at_start = limits.oom_kills()

    def describe(self) -> str:
        return f"worker {self.index} ({self.shard.describe()}, pid {self.pid})"

    def mark_exited(self) -> None:
        """Its process has exited (nothing is sent to it any more)."""
        self.exited = True

    def read_stack(self, wait_seconds: float) -> str:
        """Read what faulthandler wrote to the stack pipe, waiting up to ``wait_seconds``."""
        if self.stack.closed:
            return ""
        fd = self.stack.fileno()
        chunks: list[bytes] = []
        deadline = time.monotonic() + wait_seconds
        quiet = 0.25
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            ready, _, _ = select.select(
                [fd], [], [], min(remaining, quiet if chunks else remaining)
            )
            if not ready:
                break
            data = os.read(fd, 65536)
            if not data:
                break
            chunks.append(data)
        return b"".join(chunks).decode("utf-8", "replace")

    def send(self, message: Any) -> bool:
        """Send if the worker can still hear; False when its channel is gone."""
        if self.exited or self.channel.closed:
            return False
        try:
            self.channel.send(message)
        except (ChannelClosed, OSError):
            return False
        return True


@contextlib.contextmanager
def _main_file_hidden() -> Iterator[None]:
    """While a worker is spawned: no ``__file__`` on a main module that has no file (a script
    read from stdin has ``"<stdin>"`` there), which ``multiprocessing`` would have the child run
    again (and fail on). The child then imports no main module, as under ``python -c``: the
    checks refuse functions of such a main module (:func:`loader.config._validate.main_file`)."""
    main = sys.modules.get("__main__")
    if main is None or main_file() is not None or "__file__" not in vars(main):
        yield
        return
    path = vars(main).pop("__file__")
    try:
        yield
    finally:
        main.__file__ = path


class WorkerPool:
    """Starts one worker per spec and stops them all, bounded in time (module docstring)."""

    def __init__(self, specs: Sequence[WorkerSpec], start_method: str) -> None:
        """``start_method`` is ``spawn`` or ``forkserver`` (checked by LoaderConfig)."""
        self._context: Any = multiprocessing.get_context("spawn")
        self._server = start_worker_server(specs) if start_method == "forkserver" else None
        self._specs = list(specs)
        self.handles: list[WorkerHandle] = []
        self._closed = False
        self._lock = threading.Lock()

    @property
    def closed(self) -> bool:
        return self._closed

    def start(self) -> None:
        """Start every process (all before waiting for any). Receiving their Hello is the
        coordinator's job."""
        try:
            for index, spec in enumerate(self._specs):
                self.handles.append(self._spawn(index, spec))
        except BaseException:
            self.close()
            raise

    def _spawn(self, index: int, spec: WorkerSpec) -> WorkerHandle:
        parent_end, child_end = self._context.Pipe(duplex=True)
        stack_read, stack_write = self._context.Pipe(duplex=False)
        alive_read, alive_write = self._context.Pipe(duplex=False)
        name = f"dali-loader-worker-{index}"
        process: WorkerProcess
        if self._server is not None and not (self._server.serving and self._server.alive()):
            # (shut down, shutdown_worker_server(), while this pool lives: a worker replaced now
            # is forked from this process's server of now)
            self._server = start_worker_server(self._specs)
        if self._server is not None:
            # A forked worker gets the trainer's environment, directory and import path of now,
            # as a spawned one does (what changed since the server started reaches it too)
            fds = [child_end.fileno(), stack_write.fileno(), alive_read.fileno()]
            process = ServerWorker(self._server, name, spec, fds, dict(os.environ))
        else:
            process = self._context.Process(
                target=run_worker,
                args=(spec, child_end, stack_write, alive_read),
                name=name,
                daemon=True,
            )
        handle = WorkerHandle(
            index, spec, process, ControlChannel(parent_end), stack_read, alive_write
        )
        try:
            if self._server is None:  # (the server's forks start with the signals ignored)
                # multiprocessing's resource tracker, started at the first spawn, unblocks
                # SIGINT and SIGTERM in this thread after its own start: started before the block
                resource_tracker.ensure_running()
                with _main_file_hidden(), blocked_for_start():  # Ctrl-C: ipc.signals
                    process.start()
            else:
                process.start()
            handle.pid = process.pid
        except BaseException:
            for resource in (parent_end, stack_read, alive_write):
                resource.close()
            raise
        finally:
            child_end.close()
            stack_write.close()
            alive_read.close()
        return handle

    def replace(self, index: int, spec: WorkerSpec) -> WorkerHandle:
        """Stop worker ``index`` (SIGKILL: it is dead or stuck), release its process and pipes,
        and start a new process for ``spec`` in its place."""
        if self._closed:
            raise RuntimeError("the pool is closed")
        old = self.handles[index]
        if old.pid is not None and old.process.exitcode is None:
            with contextlib.suppress(ProcessLookupError, OSError):
                os.kill(old.pid, signal.SIGKILL)
            old.process.join(KILL_WAIT)
        old.exited = True
        for resource in (old.channel, old.stack, old.alive):
            with contextlib.suppress(OSError):
                resource.close()
        if old.process.exitcode is not None:
            with contextlib.suppress(ValueError):
                old.process.close()
        handle = self._spawn(index, spec)
        self.handles[index] = handle
        return handle

    def close(self, timeout: float = 5.0) -> None:
        """Stop every worker and release every process and pipe. Idempotent; bounded by
        ``timeout`` plus at most ``KILL_WAIT`` for workers that need SIGKILL."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        deadline = time.monotonic() + timeout
        started = [h for h in self.handles if h.pid is not None]
        for handle in started:
            handle.send(wire.Shutdown())
            # Closing the liveness pipe makes a worker stuck inside DALI exit too.
            with contextlib.suppress(OSError):
                handle.alive.close()
        self._join(started, deadline - timeout / 2)
        for sig in (STOP_SIGNAL, signal.SIGKILL):
            survivors = [h for h in started if h.process.exitcode is None]
            if not survivors:
                break
            for handle in survivors:
                with contextlib.suppress(ProcessLookupError, OSError):
                    os.kill(handle.pid, sig)  # type: ignore[arg-type]
            self._join(survivors, deadline if sig == STOP_SIGNAL else time.monotonic() + KILL_WAIT)
        for handle in self.handles:
            handle.exited = True
            for resource in (handle.channel, handle.stack, handle.alive):
                with contextlib.suppress(OSError):
                    resource.close()
        stuck = [h.index for h in started if _alive(h.process)]
        for handle in started:
            if handle.process.exitcode is not None:
                with contextlib.suppress(ValueError):
                    handle.process.close()
        if stuck:
            logger.warning("workers %s did not exit after SIGKILL", stuck)

    @staticmethod
    def _join(handles: Sequence[WorkerHandle], deadline: float) -> None:
        pending = {h.process.sentinel: h for h in handles if h.process.exitcode is None}
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            for sentinel in wait(list(pending), timeout=remaining):
                handle = pending.pop(sentinel)  # type: ignore[arg-type]
                # The sentinel closes slightly before the process becomes reapable: block on
                # waitpid (bounded) rather than polling it with WNOHANG.
                handle.process.join(max(deadline - time.monotonic(), 0.5))


def start_worker_server(specs: Sequence[WorkerSpec] = ()) -> worker_server.WorkerServer:
    """This process's worker server (started if none runs, :mod:`loader.processes.server`), asked
    to
    import the modules of the loader's functions and parse their files before it forks the
    loader's workers: those find them done instead of each importing and parsing them."""
    server = worker_server.running(by_loader=True)
    functions = [f for spec in specs[:1] for f in (spec.source, spec.step, spec.feeders)]
    found = modules_of(*functions)
    source = specs[0].source if specs else None
    needs = source.server_needs() if isinstance(source, Definition) else ()
    server.prepare([name for name, _ in found], [path for _, path in found if path], needs)
    return server


def _alive(process: WorkerProcess) -> bool:
    try:
        return process.is_alive()
    except ValueError:
        return False


def describe_exit(exitcode: int | None) -> tuple[str, str | None]:
    """(human text, signal name) for a process exit code."""
    if exitcode is None:
        return "is still running", None
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}", name
    return f"exited with code {exitcode}", None
