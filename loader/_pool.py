"""The worker pool: spawning, watching and stopping worker processes. Runs in the trainer.

The pool owns, per worker: the process, its control channel, its stack pipe (faulthandler output,
for hangs and crashes) and the write end of its liveness pipe (closing it makes the worker exit).
``close()`` is idempotent and releases every process and descriptor whatever happened before. It
is bounded: asking (Shutdown and the liveness pipe) gets half of ``timeout`` for the whole pool,
SIGTERM the other half, and SIGKILL at most :data:`KILL_WAIT` seconds more.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import select
import signal
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from ipc import ChannelClosed, ControlChannel, wire
from workers import Shard, WorkerSpec, run_worker

from . import _server

logger = logging.getLogger("loader")

#: How long close() waits for the kernel to reap workers after SIGKILL.
KILL_WAIT = 5.0


class WorkerHandle:
    """What the pool owns of one worker: its process and the pipes to it. Nothing else: the
    worker's session state is the coordinator's (:mod:`loader._session`)."""

    def __init__(
        self,
        index: int,
        spec: WorkerSpec,
        process: BaseProcess,
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
        self.eof = False  # its control channel reached end of stream (the worker is going)
        self.pid: int | None = None

    def describe(self) -> str:
        return f"worker {self.index} ({self.shard.describe()}, pid {self.pid})"

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


class WorkerPool:
    """Spawns one worker per spec and stops them all, bounded in time (module docstring)."""

    def __init__(self, specs: Sequence[WorkerSpec], start_method: str) -> None:
        """``start_method`` is ``spawn`` or ``forkserver`` (checked by LoaderConfig)."""
        self._context: Any = multiprocessing.get_context(start_method)
        self._forked = start_method == "forkserver"
        if start_method == "forkserver":
            start_worker_server(self._context, specs)
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
        # A forked worker has its server's environment: it gets the trainer's of now, as a
        # spawned one does (a variable set since the server started reaches it too)
        environ = dict(os.environ) if self._forked else None
        process = self._context.Process(
            target=run_worker,
            args=(spec, child_end, stack_write, alive_read, environ),
            name=f"dali-loader-worker-{index}",
            daemon=True,
        )
        handle = WorkerHandle(
            index, spec, process, ControlChannel(parent_end), stack_read, alive_write
        )
        try:
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
        for sig in (signal.SIGTERM, signal.SIGKILL):
            survivors = [h for h in started if h.process.exitcode is None]
            if not survivors:
                break
            for handle in survivors:
                with contextlib.suppress(ProcessLookupError, OSError):
                    os.kill(handle.pid, sig)  # type: ignore[arg-type]
            self._join(
                survivors, deadline if sig == signal.SIGTERM else time.monotonic() + KILL_WAIT
            )
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


#: What multiprocessing's own forkserver imports once, where :mod:`loader._server` cannot start
#: it (Python 3.14 and later): the worker's loop and, through it, DALI. Not ``__main__``: on
#: Python 3.11 multiprocessing never preloads it (the server gets no ``main_path``), so each
#: forked worker imports the main module itself. Forking after DALI was *imported* is safe;
#: forking after an operator *ran* is not (the child hangs on its first operator), and the
#: server never runs one.
FORKSERVER_PRELOAD = ("workers._preload",)


def start_worker_server(context: Any, specs: Sequence[WorkerSpec] = ()) -> None:
    """Make sure this process's worker server runs, with DALI and the main module imported
    once (:mod:`loader._server`): a loader's workers are forked from it without importing
    either again. Where that server is not supported, multiprocessing's own forkserver imports
    DALI once (:data:`FORKSERVER_PRELOAD`)."""
    if _server.supported():
        functions = [f for spec in specs[:1] for f in (spec.source, spec.step, spec.feeders)]
        _server.ensure_running(_server.files_of(*functions))
    else:
        context.set_forkserver_preload(list(FORKSERVER_PRELOAD))


def _alive(process: BaseProcess) -> bool:
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
