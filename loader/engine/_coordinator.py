"""The coordinator: the trainer's event loop over every worker. Runs in the trainer.

It waits on all control channels, all process sentinels and the release queue's wakeup pipe at
once (one ``select.poll``), so a record, a dead worker or a released slot each wake it at once;
there is no polling. It routes each record to its worker's session (:mod:`loader.engine._session`),
which updates itself, and acts on what the policies decide: which worker is served next
(:mod:`loader.engine._order`), whether a dead or stuck worker is replaced
(:mod:`loader.engine._healing`), when
a slot goes back (:mod:`loader.engine._releases`), what a failure becomes
(:mod:`loader.engine._failures`).
It is the only code that sends to workers, raises their failures, or closes the pool.

A wait only reports what happened; lifecycle commands (start an epoch, abort it, seek) are "send,
then wait until a condition on the sessions holds", so a worker replaced in the middle of a
command is covered by the same condition.

Invariants: only the trainer's thread that iterates calls into it; a failure closes the pool
before the exception leaves, so nothing is left running behind an error.
"""

from __future__ import annotations

import gc
import logging
import select
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ipc import ChannelClosed, ProtocolError, SlotReader, open_region, wire
from ipc.wire import Position, Sampling

from .._errors import SlotsExhaustedError, StartupError
from ..processes._pool import WorkerPool
from . import _failures
from ._healing import Fail, Healing
from ._order import ArrivalOrder, InOrder, Take
from ._releases import Releases
from ._session import Delivery, Idle, Stopped, WorkerSession
from ._stats import LoaderStats, Timeline, TrainerCounters, snapshot

logger = logging.getLogger("loader")

Limit = tuple[float | None, str]  # how long to wait, and the setting it comes from


@dataclass(frozen=True, slots=True)
class WorkerFacts:
    """What the rest of the trainer may know of one worker (a snapshot: the coordinator owns
    its sessions): its process, and the bytes and batches it has made."""

    pid: int | None
    bytes: int
    steps: int


class Coordinator:
    """Receives from every worker, drives their lifecycles; raises what goes wrong."""

    def __init__(
        self,
        pool: WorkerPool,
        healing: Healing,
        *,
        in_order: bool = True,
        stream_of: Callable[[int], int] | None = None,
        timeline: Timeline | None = None,
    ) -> None:
        """``healing``: the restart, skip and wait policy; ``stream_of(device_id)``: the
        trainer's current CUDA stream (GPU only); ``timeline``: where every batch's stage times
        go (see :mod:`loader.engine._stats`)."""
        self.pool = pool
        self.timeline = timeline or Timeline(0)
        self.healing = healing
        self.order = InOrder() if in_order else ArrivalOrder()
        self.stream_of = stream_of
        self.releases = Releases()
        self.sessions: list[WorkerSession] = []
        self.reference: wire.Signature | None = None  # the signature every worker agrees on
        self.failure: BaseException | None = None
        self.wait_ns = 0
        self._agreement_due = False
        self._fallback_warned = False
        self._poller: tuple[select.poll, dict[int, WorkerSession], dict[int, WorkerSession]]
        self._poller = None  # type: ignore[assignment]
        self._poller_key: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        self._closed = False

    # ------------------------------------------------------------------------------ lifecycle
    def start(self, timeout: float) -> None:
        """Start every worker (all before waiting for any), then wait until each said Hello."""
        self.pool.start()
        self.sessions = [WorkerSession(handle) for handle in self.pool.handles]
        self.timeline.ensure(len(self.sessions))
        deadline = time.monotonic() + timeout
        while starting := [s for s in self.sessions if not s.up]:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._fail(
                    StartupError(
                        f"{starting[0].describe()} did not start within {timeout:g} s "
                        "(startup_timeout); the machine may be overloaded"
                    )
                )
            self._wait(starting[0], (remaining, ""), startup=True)
        self._expect_signatures()

    def start_epoch(self, epoch: int, base_steps: list[int] | None = None, cursor: int = 0) -> None:
        """Every worker runs ``epoch`` (a process still starting is told after its Hello); the
        last epoch, if all its batches were delivered, is awaited first. ``base_steps``: per
        worker, the epoch's step of its first batch (a resumed epoch); ``cursor``: the worker
        whose turn is first."""
        self.finish_epoch()
        self.order.start(cursor)
        for index, session in enumerate(self.sessions):
            self._send(
                session, session.start_epoch(epoch, 0 if base_steps is None else base_steps[index])
            )

    def finish_epoch(self) -> None:
        """Wait for the end of the epoch whose batches were all delivered (a trainer that stops
        after ``len(loader)`` batches never asks for the end itself)."""
        self._until(lambda s: bool(s.queue) or not s.open_in_epoch, self.healing.wait_limit)
        extra = next((s for s in self.sessions if s.queue), None)
        if extra is not None:
            raise self._fail(
                ProtocolError(
                    f"{extra.describe()} sent more batches of epoch {extra.epoch} than its "
                    "epoch has"
                )
            )

    def abort_epoch(self, epoch: int) -> None:
        """Stop ``epoch`` everywhere and wait until every worker rebuilt its sources for the
        next one (a process still starting does it after its Hello: commands go in order)."""
        for session in self.sessions:
            while session.queue:
                self._send(session, self.releases.now(session.reader, session.queue.popleft()))
            if not isinstance(session.target, Idle):
                self._send(session, session.abort_epoch(epoch))
        self._until(_idle, self._command_limit)
        self._expect_signatures()

    def seek(self, position: Position, random: list[wire.RandomStates] | None = None) -> list[int]:
        """Every worker rebuilds its sources to start ``position.epoch`` at ``position`` (with
        ``random[worker]``, its random generators in those states); returns the batches each
        has left in that epoch."""
        self.finish_epoch()  # (an epoch over by count: its end is on its way)
        for index, session in enumerate(self.sessions):
            self._send(session, session.seek(position, b"" if random is None else random[index]))
        self._until(_idle, self._command_limit)
        self._expect_signatures()
        return [s.resumed_steps or 0 for s in self.sessions]

    def wait_signatures(self) -> None:
        """Wait until every worker whose loop traced sent its signature; checks agreement.

        A worker's traced first batch is bounded by ``startup_timeout`` (with ``timeout`` set);
        once it delivered a batch, the ordinary per-batch ``timeout`` applies to the rest."""
        self._until(lambda s: not s.signature_pending, self.healing.wait_limit)

    def _until(
        self, done: Callable[[WorkerSession], bool], limit: Callable[[WorkerSession], Limit]
    ) -> None:
        """Wait until ``done`` holds for every session, re-checked after everything that
        arrives (a worker replaced meanwhile is judged by its new process)."""
        while (waiting := next((s for s in self.sessions if not done(s)), None)) is not None:
            self._wait(waiting, limit(waiting))

    def _command_limit(self, session: WorkerSession) -> Limit:
        """A command's answer includes rebuilding the sources: the trace's limit."""
        if not session.up:
            return self.healing.wait_limit(session)
        trace = self.healing.timeouts.trace
        return trace, "" if trace is None else f"startup_timeout={trace:g}"

    def _expect_signatures(self) -> None:
        for session in self.sessions:
            session.signature_pending = True
        self._agreement_due = True

    # ------------------------------------------------------------------------------ batches
    def next_batch(self, step: int) -> Delivery | None:
        """The next batch in the loader's order, the rank's ``step`` of the epoch (what
        ``batch.info.step`` says); None when every worker's epoch is over."""
        while True:
            decision = self.order.choose(self.sessions)
            if decision is None:
                return None
            if isinstance(decision, Take):
                self._send_releases(lazy=True)
                return self._deliver(self.sessions[decision.worker], step)
            blocked = [self.sessions[index] for index in decision.blocked]
            if all(s.reader.all_held for s in blocked):
                self._send_releases(lazy=False)
                if all(s.reader.all_held for s in blocked):
                    self._collect_views(blocked[0])
            waiting = self.sessions[decision.worker]
            self._wait(waiting, self.healing.wait_limit(waiting))

    def _deliver(self, session: WorkerSession, step: int) -> Delivery:
        descriptor = session.queue[0]
        if descriptor.skipped:  # (checked before any view of the slot is made)
            sampling = self.sampling()
            error = self.healing.delivered(descriptor, 0 if sampling is None else sampling.total)
            if error is not None:
                raise self._fail(error)
        return session.deliver(step)

    def release_at_once(self, worker: int, reader: SlotReader, descriptor: wire.BatchReady) -> None:
        """The batch is a private copy (``copy=True``): its slot goes back now."""
        session = self.sessions[worker]
        if session.reader is reader:
            self._send(session, self.releases.now(reader, descriptor))

    def output_kind(self, worker: int) -> str:
        signature = self.reference or self.sessions[worker].signature
        return signature.output_kind if signature is not None else "dict"

    def _collect_views(self, session: WorkerSession) -> None:
        """Before declaring every slot held: collect dead views and send their releases."""
        gc.collect()
        self._send_releases(lazy=False)
        if session.reader.all_held and not session.queue:
            raise self._fail(
                SlotsExhaustedError(
                    f"the trainer holds all {session.reader.num_slots} shared-memory slots of "
                    f"{session.describe()} through live batch views, so it cannot produce the "
                    "next batch. Drop references to old batches (or their arrays/tensors), pass "
                    "copy=True to get private copies, or raise prefetch="
                )
            )

    def _send_releases(self, *, lazy: bool) -> None:
        for worker, record in self.releases.due(self.sessions, lazy=lazy):
            self.sessions[worker].handle.send(record)

    # ------------------------------------------------------------------------------ queries
    def sampling(self) -> Sampling | None:
        """The sampling every worker's source reported (None: not a sharded root)."""
        found = {s.hello.sampling if s.hello else None for s in self.sessions}
        return next(iter(found)) if len(found) == 1 else None

    def steps_per_epoch(self) -> int | None:
        """Batches per epoch over this rank's workers (None when a source cannot say)."""
        steps = [s.hello.steps_per_epoch if s.hello else None for s in self.sessions]
        return None if None in steps else sum(s for s in steps if s is not None)

    def next_epoch(self) -> int | None:
        """The epoch every worker starts at its next ``StartEpoch`` without a seek: the one
        after the epoch it runs or ran, or the one its sources were built for (None when the
        workers differ, which a seek settles)."""
        epochs = {s.next_epoch for s in self.sessions}
        return next(iter(epochs)) if len(epochs) == 1 else None

    def worker_facts(self) -> tuple[WorkerFacts, ...]:
        """A snapshot of every worker, for tuning."""
        return tuple(
            WorkerFacts(s.handle.pid, s.counters.bytes, s.counters.steps) for s in self.sessions
        )

    def agreement_fields(self) -> dict[str, Any] | None:
        """What every rank's workers must agree on, from the signature they all sent (None
        before one arrived)."""
        reference = self.reference
        return None if reference is None else dict(reference.agreement_fields())

    def batches_held(self) -> bool:
        """Whether the trainer still holds a batch of any worker (slots not given back)."""
        return any(s.reader.held for s in self.sessions)

    def worker_names(self) -> list[str]:
        """Each worker as a trace names it: its index, shard and process."""
        return [
            f"worker {s.index} (shard {s.shard.index}/{s.shard.count}, pid {s.handle.pid})"
            for s in self.sessions
        ]

    def delivered(self) -> list[int]:
        """Per worker, the batches of the epoch in progress handed to the user."""
        return [s.delivered for s in self.sessions]

    def random_states(self) -> list[wire.RandomStates]:
        """Per worker, the random generator states of its first batch not yet delivered."""
        return [s.random for s in self.sessions]

    def pids(self) -> list[int]:
        return [s.handle.pid for s in self.sessions if s.handle.pid is not None]

    def stats(self, trainer: TrainerCounters, window: float = 10.0, cpus: int = 1) -> LoaderStats:
        healing = self.healing
        return snapshot(
            self.sessions,
            trainer,
            now=time.monotonic(),
            wait_ns=self.wait_ns,
            skipped=healing.skipped,
            restarts=healing.restarts,
            timeline=self.timeline,
            window=window,
            cpus=cpus,
        )

    # ------------------------------------------------------------------------------ the loop
    def _wait(self, wanted: WorkerSession, limit: Limit, *, startup: bool = False) -> None:
        """Wait until something arrives, then handle everything that did. When ``limit`` passes
        with nothing from anyone, ``wanted`` is stuck (healed or failed; at startup the caller
        decides). Anything that escapes (a failure, a torn record, an interrupt) closes the pool
        first."""
        try:
            self._wait_once(wanted, limit, startup)
        except BaseException as error:
            if self.failure is None:
                self._fail(error)
            raise

    def _wait_once(self, wanted: WorkerSession, limit: Limit, startup: bool) -> None:
        timeout, setting = limit
        self.releases.queue.waiting = True  # from here, a finalizer on this thread wakes us
        try:
            # lazy: releases a worker does not need to go on are held back (see Releases.due)
            self._send_releases(lazy=True)
            poller, channels, sentinels = self._poller_for_live_sessions()
            started = time.perf_counter_ns()
            ready = poller.poll(None if timeout is None else max(0, int(timeout * 1000)))
            self.wait_ns += time.perf_counter_ns() - started
        finally:
            self.releases.queue.waiting = False
        if not ready:
            if not startup:
                assert timeout is not None  # (a wait without a limit does not time out)
                self._heal(wanted, *_failures.timed_out(wanted, timeout, setting))
            return
        died: list[WorkerSession] = []
        for fd, _events in ready:
            if fd in channels:
                self._drain(channels[fd])
            elif fd in sentinels:
                died.append(sentinels[fd])
            elif fd == self.releases.queue.wakeup_fd:
                self.releases.queue.clear_wakeup()
        for session in died:
            self._drain(session)  # a failure record sent just before exiting explains the exit
            self._heal(session, *_failures.died(session))
        self._send_releases(lazy=True)

    def _poller_for_live_sessions(
        self,
    ) -> tuple[select.poll, dict[int, WorkerSession], dict[int, WorkerSession]]:
        """One ``select.poll`` over live channels, sentinels and the wakeup pipe, rebuilt only
        when the set of live workers changes (``multiprocessing.connection.wait`` would build a
        selector on every call)."""
        live = tuple(
            s.index for s in self.sessions if not s.handle.exited and not s.handle.channel.closed
        )
        at_eof = tuple(s.index for s in self.sessions if s.handle.eof)
        if self._poller is None or self._poller_key != (live, at_eof):
            poller = select.poll()
            channels: dict[int, WorkerSession] = {}
            sentinels: dict[int, WorkerSession] = {}
            for index in live:
                session = self.sessions[index]
                if not session.handle.eof:
                    channels[session.handle.channel.fileno()] = session
                sentinels[session.handle.process.sentinel] = session
            for fd in (*channels, *sentinels, self.releases.queue.wakeup_fd):
                poller.register(fd, select.POLLIN)
            self._poller = (poller, channels, sentinels)
            self._poller_key = (live, at_eof)
        return self._poller

    def _drain(self, session: WorkerSession) -> None:
        """Handle every record the worker sent so far (one receive)."""
        channel = session.handle.channel
        try:
            records = channel.receive_ready()
        except ChannelClosed:  # this end was closed (the worker is being replaced)
            records = []
        for record in records:
            self._dispatch(session, record)
        if channel.at_eof:
            # The worker is gone or going: from now on only its sentinel is waited on, which
            # fires once the process has exited (no spinning on a readable end of stream).
            session.handle.eof = True
            self._poller = None  # type: ignore[assignment]

    def _dispatch(self, session: WorkerSession, record: Any) -> None:
        if isinstance(record, wire.BatchReady):
            self.timeline.batch(session.index, session.epoch_step(record.step), record)
            if session.on_batch(record):
                self.order.arrived(session.index)
            else:  # a batch of an epoch the trainer left
                self._send(session, self.releases.now(session.reader, record))
        elif isinstance(record, (wire.ArenaReady, wire.CudaRingReady)):
            session.reader.attach(open_region(record, session.handle.channel, self.stream_of))
        elif isinstance(record, (wire.Signature, wire.EpochEnd)):
            if isinstance(record, wire.Signature):
                session.on_signature(record)
            else:
                session.on_epoch_end(record)
            self._check_agreement()
        elif isinstance(record, wire.EpochAborted):
            session.on_aborted(record)
        elif isinstance(record, wire.Sought):
            session.on_sought(record)
        elif isinstance(record, wire.Hello):
            self._send(session, session.on_hello(record))
        elif isinstance(record, wire.SamplesFailed):
            self._tell_others(session, self.healing.samples_failed(session, record))
        elif isinstance(record, wire.WorkerFailure):
            raise self._fail(_failures.relayed(session, record))
        elif isinstance(record, wire.WarningRelay):
            _failures.relay_warning(session, record)
        elif isinstance(record, wire.LogRelay):
            logger.log(record.level, "worker %d: %s", session.index, record.message)
        else:
            raise self._fail(
                ProtocolError(
                    f"{session.describe()} sent an unknown record {type(record).__name__}"
                )
            )

    def _check_agreement(self) -> None:
        """Once every pending signature arrived: every worker traced the same loop."""
        if not self._agreement_due or any(s.signature_pending for s in self.sessions):
            return
        self._agreement_due = False
        error, fell_back = _failures.disagreement(self.sessions)
        if error is not None:
            raise self._fail(error)
        self.reference = next((s.signature for s in self.sessions if s.signature), None)
        if fell_back and not self._fallback_warned:
            self._fallback_warned = True
            _failures.warn_fallback(fell_back)

    # ------------------------------------------------------------------------------ acting
    def _send(self, session: WorkerSession, record: Any) -> None:
        if record is not None:
            session.handle.send(record)

    def _tell_others(self, session: WorkerSession, record: wire.BadSamples | None) -> None:
        for other in self.sessions:
            if other is not session:
                self._send(other, record)

    def _heal(self, session: WorkerSession, error: BaseException, cause: str) -> None:
        """Replace ``session``'s worker when the healing policy allows; else raise ``error``."""
        decision, found = self.healing.decide(session, error, cause)
        self._tell_others(session, found)
        if isinstance(decision, Fail):
            raise self._fail(decision.error)
        if decision.budgeted:
            session.counters.restarts += 1
        session.drop_process()
        handle = self.pool.replace(session.index, decision.spec)
        session.replaced(handle, decision.target, decision.first_step)
        self.healing.started(session)
        self._agreement_due = True
        self._poller = None  # type: ignore[assignment]

    def fail(self, error: BaseException) -> BaseException:
        """Record a failure found outside the loop (across ranks) and stop the pool."""
        return self._fail(error)

    def _fail(self, error: BaseException) -> BaseException:
        """Record the failure and stop the pool; returns the error for the caller to raise."""
        if self.failure is None:
            self.failure = error
        for session in self.sessions:
            session.go(Stopped(failed=True))
        self.close()
        return error

    def close(self) -> None:
        """Close the trainer's side of every region first (CUDA: imports are closed before the
        exporting worker frees them), then stop the workers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for session in self.sessions:
            session.queue.clear()
            session.reader.close()
            if not isinstance(session.target, Stopped):
                session.go(Stopped(failed=False))
        self.pool.close()
        self.releases.close()


def _idle(session: WorkerSession) -> bool:
    return session.up and isinstance(session.target, Idle)
