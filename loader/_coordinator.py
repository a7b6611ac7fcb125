"""The coordinator: the trainer's end of every worker's control channel. Runs in the trainer.

It waits on all channels, all process sentinels and the release queue's wakeup pipe at once, so
a message, a dead worker or a released slot each wake it immediately; there is no polling. It
turns what workers send into state (queued batches, signatures, epoch ends) and every failure into
one exception with the worker, shard, epoch and step in its message.

Invariants: only the trainer's thread that iterates calls into it; a failure closes the pool
before the exception leaves, so nothing is left running behind an error.
"""

from __future__ import annotations

import builtins
import contextlib
import gc
import logging
import os
import select
import signal
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ipc import Arena, ChannelClosed, SharedMemoryError
from ipc import _wire as wire

from ._errors import (
    AgreementError,
    RemoteTraceback,
    SlotsExhaustedError,
    StartupError,
    WorkerDiedError,
    WorkerError,
    WorkerTimeoutError,
)
from ._pool import WorkerHandle, WorkerPool, describe_exit
from ._views import ReleaseQueue

logger = logging.getLogger("loader")

NOTHING_CAPTURED = "no operators were captured"

#: Non-builtin exception types a worker may raise that the trainer re-creates as they are.
KNOWN_TYPES: dict[tuple[str, str], type[Exception]] = {
    (SharedMemoryError.__module__, SharedMemoryError.__qualname__): SharedMemoryError,
}

#: Known DALI messages, and what to change in the loader's terms.
HINTS = (
    (
        "Checkpointing is currently not supported in capture mode",
        "the loader runs DALI capture mode, which cannot checkpoint: build the reader in "
        "source() without enable_checkpointing=True (or pass capture=False to Loader).",
    ),
    (
        "Expected batch size",
        "an ExternalSource root must yield full batches: build it with sharded_source(), which "
        "pads (flagging padded rows) or drops the last partial batch.",
    ),
    (
        "cannot switch to capture mode",
        "source() must return a reader that was never iterated; the loader iterates it.",
    ),
)


class Coordinator:
    """Receives from every worker; raises what goes wrong. See the module docstring."""

    def __init__(self, pool: WorkerPool, *, timeout: float | None) -> None:
        self.pool = pool
        self.handles = pool.handles
        self.timeout = timeout
        self.releases = ReleaseQueue()
        self.pending_signatures: set[int] = set()
        self.reference: wire.Signature | None = None
        self.fallback_warned = False
        self.wait_ns = 0
        self.failure: BaseException | None = None
        self._poller: tuple[select.poll, dict[int, WorkerHandle], dict[int, WorkerHandle]] | None
        self._poller = None
        self._poller_key: tuple[int, ...] = ()
        self._pending_releases: dict[int, list[tuple[int, int]]] = {}
        #: device id -> the trainer's current CUDA stream handle (set by the Loader for GPU).
        self.cuda_stream: Callable[[int], int] | None = None

    # ------------------------------------------------------------------------------ waiting
    def wait_startup(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while any(h.hello is None for h in self.handles):
            waiting_for = next(h for h in self.handles if h.hello is None)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._fail(
                    StartupError(
                        f"{waiting_for.describe()} did not start within {timeout:.0f} s "
                        "(startup_timeout); the machine may be overloaded"
                    )
                )
            self.pump(waiting_for, remaining, startup=True)
        self.pending_signatures = {h.index for h in self.handles}

    def pump(
        self, wanted: WorkerHandle | None, timeout: float | None, *, startup: bool = False
    ) -> None:
        """Wait until something arrives, then handle everything that did.

        Raises ``WorkerTimeoutError`` when ``timeout`` passes with nothing from anyone. Anything
        that escapes (a failure, a torn record, an interrupt) closes the pool first.
        """
        with self._closing_on_error():
            self._pump(wanted, timeout, startup=startup)

    def _pump(self, wanted: WorkerHandle | None, timeout: float | None, *, startup: bool) -> None:
        self.releases.waiting = True  # from here, a finalizer on this thread wakes the wait
        try:
            self.flush_releases()
            poller, channels, sentinels = self._poller_for_live_handles()
            started = time.perf_counter_ns()
            ready = poller.poll(None if timeout is None else max(0, int(timeout * 1000)))
            self.wait_ns += time.perf_counter_ns() - started
        finally:
            self.releases.waiting = False
        if not ready:
            assert wanted is not None
            if startup:
                return
            raise self._timeout(wanted, timeout)
        died: list[WorkerHandle] = []
        for fd, _events in ready:
            if fd in channels:
                self._drain(channels[fd])
            elif fd in sentinels:
                died.append(sentinels[fd])
            elif fd == self.releases.wakeup_fd:
                self.releases.clear_wakeup()
        for handle in died:
            self._drain(handle)  # a failure record sent just before exiting explains the exit
            raise self._died(handle)
        self.flush_releases()

    def _poller_for_live_handles(
        self,
    ) -> tuple[select.poll, dict[int, WorkerHandle], dict[int, WorkerHandle]]:
        """One ``select.poll`` over live channels, sentinels and the wakeup pipe, rebuilt only
        when the set of live workers changes (``multiprocessing.connection.wait`` would build a
        selector on every call)."""
        live = tuple(h.index for h in self.handles if not h.exited and not h.channel.closed)
        if self._poller is None or self._poller_key != live:
            poller = select.poll()
            channels: dict[int, WorkerHandle] = {}
            sentinels: dict[int, WorkerHandle] = {}
            for index in live:
                handle = self.handles[index]
                channels[handle.channel.fileno()] = handle
                sentinels[handle.process.sentinel] = handle
            for fd in (*channels, *sentinels, self.releases.wakeup_fd):
                poller.register(fd, select.POLLIN)
            self._poller = (poller, channels, sentinels)
            self._poller_key = live
        return self._poller

    def take_ready(self, handle: WorkerHandle) -> bool:
        """Handle what ``handle`` already sent, without waiting; False when it sent nothing."""
        if handle.exited or handle.channel.closed:
            return False
        if not handle.channel.ready():
            return False
        with self._closing_on_error():
            self._drain(handle)
        return True

    @contextlib.contextmanager
    def _closing_on_error(self) -> Iterator[None]:
        """Anything escaping the block (a failure, a torn record, an interrupt) closes the pool."""
        try:
            yield
        except BaseException as error:
            if self.failure is None:
                self._fail(error)
            raise

    def _drain(self, handle: WorkerHandle) -> None:
        channel = handle.channel
        try:
            while channel.ready():
                self.dispatch(handle, channel.recv())
        except ChannelClosed:
            return

    def flush_releases(self, *, lazy: bool = False) -> None:
        """Send queued releases, one record per worker. ``lazy`` keeps a worker's releases
        queued while it still has at least half its slots (fewer, larger records)."""
        pending = self._pending_releases
        for worker, slot, generation in self.releases.take():
            handle = self.handles[worker]
            if handle.ledger.release(slot, generation):
                self._mark_cuda_free(handle, slot)
                pending.setdefault(worker, []).append((slot, generation))
        for worker in list(pending):
            handle = self.handles[worker]
            fills = pending[worker]
            if (
                lazy
                and len(fills) < max(1, handle.ledger.num_slots // 2)
                and (handle.ledger.held + len(fills) < handle.ledger.num_slots)
            ):
                continue
            del pending[worker]
            handle.send(wire.Release(tuple(fills)))

    def _mark_cuda_free(self, handle: WorkerHandle, slot: int) -> None:
        """Record the slot's "free" event on the trainer's current stream (CUDA rings only)."""
        arena_id = handle.fill_arena.pop(slot, None)
        for importer in (handle.cuda, *handle.retired_cuda):
            if importer is not None and importer.arena_id == arena_id:
                assert self.cuda_stream is not None
                importer.mark_free(slot, self.cuda_stream(importer.device_id))
                return

    def release_now(self, handle: WorkerHandle, descriptor: wire.BatchReady) -> None:
        if handle.ledger.release(descriptor.slot, descriptor.generation):
            self._mark_cuda_free(handle, descriptor.slot)
            handle.send(wire.Release(((descriptor.slot, descriptor.generation),)))

    def collect_views(self, handle: WorkerHandle) -> None:
        """Before declaring every slot held: collect dead views and send their releases."""
        gc.collect()
        self.flush_releases()
        if handle.ledger.all_held and not handle.queue:
            raise self._fail(
                SlotsExhaustedError(
                    f"the trainer holds all {handle.ledger.num_slots} shared-memory slots of "
                    f"{handle.describe()} through live batch views, so it cannot produce the next "
                    "batch. Drop references to old batches (or their arrays/tensors), pass "
                    "copy=True to get private copies, or raise prefetch="
                )
            )

    # ------------------------------------------------------------------------------ messages
    def dispatch(self, handle: WorkerHandle, message: Any) -> None:
        if isinstance(message, wire.BatchReady):
            handle.ledger.receive(message.slot, message.generation)
            handle.fill_arena[message.slot] = message.arena_id
            known = {a.arena_id for a in (handle.arena, handle.cuda) if a is not None}
            if message.arena_id not in known:
                raise self._fail(
                    RuntimeError(f"{handle.describe()} sent a batch for an unknown arena")
                )
            if message.epoch != handle.epoch:
                self.release_now(handle, message)  # a batch of an epoch the trainer left
                return
            handle.queue.append(message)
            handle.last_step = message.step
            handle.steps += 1
            handle.bytes += message.nbytes
            handle.blocked_ns += message.blocked_ns
            handle.busy_ns += message.busy_ns
        elif isinstance(message, wire.ArenaReady):
            fd = handle.channel.recv_fd()
            arena = Arena.attach(fd, message.arena_id, message.slot_size, message.num_slots)
            if handle.arena is not None:
                handle.arena.close()  # live views keep the old mapping until they die
            handle.arena = arena
            handle.ledger.resize(message.num_slots)
        elif isinstance(message, wire.CudaRingReady):
            from ipc._cuda import CudaImporter

            importer = CudaImporter(
                message.arena_id,
                message.device_id,
                message.slot_size,
                message.memory_handles,
                message.ready_handles,
            )
            if handle.cuda is not None:
                handle.retired_cuda.append(handle.cuda)  # live views may still use it
            handle.cuda = importer
            handle.ledger.resize(len(message.memory_handles))
            handle.send(wire.CudaFreeEvents(message.arena_id, importer.free_handles))
        elif isinstance(message, wire.Signature):
            handle.signature = message
            handle.trace_seconds.append(message.trace_seconds)
            self.pending_signatures.discard(handle.index)
            if not self.pending_signatures:
                self.check_agreement()
        elif isinstance(message, wire.EpochEnd):
            handle.ended_epoch = message.epoch
            handle.traces = message.traces
            handle.rebuilds = message.rebuilds
            if handle.index in self.pending_signatures:
                self.pending_signatures.discard(handle.index)
                if not self.pending_signatures:
                    self.check_agreement()
        elif isinstance(message, wire.EpochAborted):
            handle.aborted_epoch = message.epoch
        elif isinstance(message, wire.WorkerFailure):
            raise self._fail(self.relay_failure(handle, message))
        elif isinstance(message, wire.WarningRelay):
            self.relay_warning(handle, message)
        elif isinstance(message, wire.LogRelay):
            logger.log(message.level, "worker %d: %s", handle.index, message.message)
        elif isinstance(message, wire.Hello):
            handle.hello = message
        else:
            raise self._fail(
                RuntimeError(f"{handle.describe()} sent an unknown record {type(message).__name__}")
            )

    # ------------------------------------------------------------------------------ agreement
    def check_agreement(self) -> None:
        """Every worker's signature must match worker 0's (or the first one seen)."""
        signed = [h for h in self.handles if h.signature is not None]
        if not signed:
            return
        reference_handle = signed[0]
        reference = reference_handle.signature
        assert reference is not None
        for handle in signed[1:]:
            signature = handle.signature
            assert signature is not None
            expected = reference.agreement_fields()
            for field, value in signature.agreement_fields().items():
                if value != expected[field]:
                    raise self._fail(
                        AgreementError(
                            f"{handle.describe()} disagrees with worker "
                            f"{reference_handle.index} on {field}: "
                            f"{_short(value)} != {_short(expected[field])}. Every worker must "
                            "trace the same loop: make source(shard) and step() give the same "
                            "batch size, device and outputs on every shard"
                        )
                    )
        self.reference = reference
        fell_back = [
            h
            for h in signed
            if h.signature and h.signature.capture_requested and not h.signature.captured
        ]
        if fell_back and not self.fallback_warned:
            self.fallback_warned = True
            names = ", ".join(f"{h.index} ({h.shard.describe()})" for h in fell_back)
            warnings.warn(
                f"capture=True was specified but no operators were captured during tracing in "
                f"worker(s) {names}; they run step() eagerly. Make step() call DALI operators "
                "(arithmetic, slicing and ndd.math are not captured), or pass capture=False",
                UserWarning,
                stacklevel=4,
            )

    # ------------------------------------------------------------------------------ failures
    def where(self, handle: WorkerHandle, epoch: int | None, step: int | None) -> str:
        parts = [f"worker {handle.index}", handle.shard.describe()]
        parts.append(f"epoch {epoch}" if epoch is not None else "before the first epoch")
        if step is not None:
            parts.append(f"step {step}")
        return ", ".join(parts)

    def relay_failure(self, handle: WorkerHandle, failure: wire.WorkerFailure) -> BaseException:
        where = self.where(handle, failure.epoch, failure.step)
        message = f"{failure.message} [{where}, in {failure.phase}]"
        for pattern, hint in HINTS:
            if pattern in failure.message:
                message += f" Hint: {hint}"
        error: BaseException | None = None
        known = KNOWN_TYPES.get((failure.type_module, failure.type_name))
        if known is not None:
            error = known(message)
        elif failure.type_module == "builtins":
            kind = getattr(builtins, failure.type_name, None)
            if isinstance(kind, type) and issubclass(kind, Exception):
                try:
                    error = kind(message)
                except Exception:
                    error = None
        if error is None:
            error = WorkerError(
                f"{failure.type_module}.{failure.type_name}: {message}",
                remote_type=f"{failure.type_module}.{failure.type_name}",
            )
        for name, value in (
            ("worker", handle.index),
            ("shard", handle.shard.index),
            ("epoch", failure.epoch),
            ("step", failure.step),
            ("remote_traceback", failure.traceback),
        ):
            setattr(error, name, value)
        error.__cause__ = RemoteTraceback(failure.traceback)
        return error

    def relay_warning(self, handle: WorkerHandle, relay: wire.WarningRelay) -> None:
        if NOTHING_CAPTURED in relay.message:
            return  # reported once, for all workers, by check_agreement
        category: type[Warning] = UserWarning
        if relay.category_module == "builtins":
            found = getattr(builtins, relay.category_name, None)
            if isinstance(found, type) and issubclass(found, Warning):
                category = found
        warnings.warn_explicit(
            f"[worker {handle.index}] {relay.message}",
            category,
            relay.filename,
            relay.lineno,
            module=f"worker{handle.index}",
        )

    def _died(self, handle: WorkerHandle) -> BaseException:
        handle.process.join(0.5)
        exitcode = handle.process.exitcode
        text, signal_name = describe_exit(exitcode)
        stack = handle.read_stack(0.2)
        handle.exited = True
        last = "no batch yet" if handle.last_step is None else f"last step sent {handle.last_step}"
        epoch = handle.epoch
        message = (
            f"{handle.describe()} {text} unexpectedly [{self.where(handle, epoch, None)}, {last}]"
        )
        if stack.strip():
            message += f"\n--- worker stack (faulthandler) ---\n{stack.rstrip()}"
        return self._fail(
            WorkerDiedError(
                message,
                worker=handle.index,
                pid=handle.pid,
                exitcode=exitcode,
                signal_name=signal_name,
            )
        )

    def _timeout(self, handle: WorkerHandle, timeout: float | None) -> BaseException:
        stack = ""
        if handle.pid is not None and not handle.exited:
            try:
                os.kill(handle.pid, signal.SIGUSR1)
                stack = handle.read_stack(1.5)
            except (ProcessLookupError, OSError):
                stack = ""
        message = (
            f"{handle.describe()} sent nothing for {timeout} s (timeout=) "
            f"[{self.where(handle, handle.epoch, handle.last_step)}]"
        )
        message += (
            f"\n--- worker stack (faulthandler) ---\n{stack.rstrip()}"
            if stack.strip()
            else "\n(the worker's stack could not be read)"
        )
        return self._fail(WorkerTimeoutError(message, worker=handle.index, stack=stack))

    def _fail(self, error: BaseException) -> BaseException:
        """Record the failure and stop the pool; returns the error for the caller to raise."""
        if self.failure is None:
            self.failure = error
        self.close()
        return error

    def close(self) -> None:
        self.pool.close()
        self.releases.close()

    def send_all(self, message: Any, handles: Iterable[WorkerHandle] | None = None) -> None:
        for handle in self.handles if handles is None else handles:
            handle.send(message)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 300 else text[:297] + "..."
