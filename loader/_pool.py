"""The worker pool: spawning, watching and stopping worker processes. Runs in the trainer.

The pool owns, per worker: the process, its control channel, its stack pipe (faulthandler output,
for hangs and crashes), the write end of its liveness pipe (closing it makes the worker exit), and
the arena the worker shared. ``close()`` is idempotent, bounded by one deadline for the whole pool
(ask -> join -> SIGTERM -> SIGKILL), and releases every descriptor whatever happened before.
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
from collections import deque
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from ipc import Arena, ChannelClosed, ControlChannel, SlotLedger
from ipc import _wire as wire
from workers import Shard, WorkerSpec
from workers._entry import run_worker

logger = logging.getLogger("loader")

SUPPORTED_START_METHODS = ("spawn", "forkserver")


class WorkerHandle:
    """The trainer's side of one worker."""

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
        self.ledger = SlotLedger(spec.num_slots)
        self.arena: Arena | None = None
        self.cuda: Any = None  # ipc CudaImporter of the worker's current CUDA ring
        self.retired_cuda: list[Any] = []
        self.fill_arena: dict[int, int] = {}  # slot -> arena id of the fill the trainer holds
        self.queue: deque[wire.BatchReady] = deque()
        self.hello: wire.Hello | None = None
        self.signature: wire.Signature | None = None
        self.ended_epoch: int | None = None
        self.aborted_epoch: int | None = None
        self.last_step: int | None = None
        self.epoch: int | None = None
        self.exited = False
        self.pid: int | None = None
        # statistics
        self.steps = 0
        self.bytes = 0
        self.blocked_ns = 0
        self.busy_ns = 0
        self.traces = 0
        self.rebuilds = 0
        self.trace_seconds: list[float] = []

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
    """Spawns one worker per spec and stops them all, always within one deadline."""

    def __init__(self, specs: Sequence[WorkerSpec], start_method: str) -> None:
        if start_method == "fork":
            raise ValueError(
                "start_method='fork' is refused: a process forked after DALI ran hangs on its "
                "first operator. Use 'spawn' (the default) or 'forkserver'"
            )
        if start_method not in SUPPORTED_START_METHODS:
            raise ValueError(
                f"start_method must be one of {SUPPORTED_START_METHODS}, got {start_method!r}"
            )
        self._context: Any = multiprocessing.get_context(start_method)
        self._specs = list(specs)
        self.handles: list[WorkerHandle] = []
        self._closed = False
        self._lock = threading.Lock()

    @property
    def closed(self) -> bool:
        return self._closed

    def start(self) -> None:
        """Start every process. Receiving their Hello is the coordinator's job."""
        try:
            for index, spec in enumerate(self._specs):
                parent_end, child_end = self._context.Pipe(duplex=True)
                stack_read, stack_write = self._context.Pipe(duplex=False)
                alive_read, alive_write = self._context.Pipe(duplex=False)
                process = self._context.Process(
                    target=run_worker,
                    args=(spec, child_end, stack_write, alive_read),
                    name=f"dali-loader-worker-{index}",
                    daemon=True,
                )
                handle = WorkerHandle(
                    index, spec, process, ControlChannel(parent_end), stack_read, alive_write
                )
                self.handles.append(handle)
                try:
                    process.start()
                    handle.pid = process.pid
                finally:
                    child_end.close()
                    stack_write.close()
                    alive_read.close()
        except BaseException:
            self.close()
            raise

    def close(self, timeout: float = 5.0) -> None:
        """Stop every worker and release everything. Idempotent; bounded by ``timeout``."""
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
            self._join(survivors, deadline if sig == signal.SIGTERM else time.monotonic() + 5.0)
        for handle in self.handles:
            handle.exited = True
            for resource in (handle.channel, handle.stack, handle.alive):
                with contextlib.suppress(OSError):
                    resource.close()
            if handle.arena is not None:
                handle.arena.close()
                handle.arena = None
            for importer in [*handle.retired_cuda, handle.cuda]:
                if importer is not None:
                    importer.close()
            handle.cuda = None
            handle.retired_cuda = []
            handle.queue.clear()
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
