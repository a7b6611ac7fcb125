"""The coordinator: the trainer's end of every worker's control channel. Runs in the trainer.

It owns every worker's session (:mod:`loader._session`) and is the only code that moves a worker
through its lifecycle: start an epoch, abort it, take the next batch in order, fail. It waits on
all channels, all process sentinels and the release queue's wakeup pipe at once, so a message, a
dead worker or a released slot each wake it immediately; there is no polling. It turns what
workers send into state (queued batches, signatures, epoch ends) and every failure into one
exception with the worker, shard, epoch and step in its message.

Invariants: only the trainer's thread that iterates calls into it; a failure closes the pool
before the exception leaves, so nothing is left running behind an error.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import gc
import logging
import os
import select
import signal
import sys
import time
import warnings
from collections import deque
from collections.abc import Callable
from typing import Any

from ipc import ChannelClosed, ProtocolError, SlotReader, open_region, wire
from workers import Position, continue_from

from ._errors import (
    AgreementError,
    RemoteTraceback,
    SharedMemoryError,
    SlotsExhaustedError,
    StartupError,
    WorkerDiedError,
    WorkerError,
    WorkerTimeoutError,
)
from ._pool import WorkerHandle, WorkerPool, describe_exit
from ._session import WorkerSession, WorkerState, choose_worker
from ._validate import MAIN_GUARD_HINT
from ._views import ReleaseQueue

logger = logging.getLogger("loader")

NOTHING_CAPTURED = "no operators were captured"

#: With ``timeout`` set, the longest a replacement process may take to start (spawn, imports,
#: sources) before its Hello, unless ``startup_timeout`` or ``timeout`` says otherwise.
REPLACEMENT_START = 60.0

#: Exception types of ``ipc`` a worker may raise, and the loader's class the trainer raises.
KNOWN_TYPES: dict[tuple[str, str], type[Exception]] = {
    ("ipc._arena", "SharedMemoryError"): SharedMemoryError,
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
    """Receives from every worker, drives their lifecycles; raises what goes wrong."""

    def __init__(
        self,
        pool: WorkerPool,
        *,
        timeout: float | None,
        trace_timeout: float | None,
        stream_of: Callable[[int], int] | None = None,
        max_restarts: int = 0,
        startup_timeout: float = 300.0,
        in_order: bool = True,
    ) -> None:
        """``timeout``: per batch once a worker's loop runs; ``trace_timeout``: for a worker's
        traced first batch (and after a rebuild); ``stream_of(device_id)``: the trainer's
        current CUDA stream (GPU only); ``max_restarts``: dead or stuck workers this loader may
        replace."""
        self.pool = pool
        self.max_restarts = max_restarts
        self.bad_samples: set[int] = set()  # on_error="skip": samples that fail inside DALI
        self.startup_timeout = startup_timeout  # a replacement's start, like the first one's
        self.in_order = in_order
        self._arrivals: deque[int] = deque()  # in_order=False: workers, as their batches came
        self.restarts = 0
        #: worker -> its replacement process, and the traces counted before it started
        self._replacements: dict[int, tuple[WorkerHandle, int]] = {}
        #: the position load_state_dict() resumed from (its epoch's sources start there)
        self.resume_position: Position | None = None
        self.sessions: list[WorkerSession] = []
        self.timeout = timeout
        self.trace_timeout = trace_timeout
        self.stream_of = stream_of
        self.releases = ReleaseQueue()
        self.reference: wire.Signature | None = None
        self.fallback_warned = False
        self.wait_ns = 0
        self.failure: BaseException | None = None
        self._poller: tuple[select.poll, dict[int, WorkerSession], dict[int, WorkerSession]]
        self._poller = None  # type: ignore[assignment]
        self._poller_key: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        #: releases not sent yet, per slot reader (a replaced process's reader is dropped)
        self._pending_releases: dict[SlotReader, list[tuple[int, int]]] = {}
        self._closed = False
        self._signatures_pending = 0  # sessions with signature_pending set

    # ------------------------------------------------------------------------------ lifecycle
    def start(self, timeout: float) -> None:
        """Start every worker (all before waiting for any), then wait until each said Hello."""
        self.pool.start()
        self.sessions = [WorkerSession(handle) for handle in self.pool.handles]
        self.wait_startup(timeout)

    def wait_startup(self, timeout: float) -> None:
        """Wait until every worker said Hello (each is then READY)."""
        deadline = time.monotonic() + timeout
        while True:
            starting = [s for s in self.sessions if s.state == WorkerState.STARTING]
            if not starting:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._fail(
                    StartupError(
                        f"{starting[0].describe()} did not start within {timeout:g} s "
                        "(startup_timeout); the machine may be overloaded"
                    )
                )
            self.pump(starting[0], remaining, startup=True)
        self._expect_signatures()

    def _expect_signatures(self) -> None:
        for session in self.sessions:
            session.signature_pending = True
        self._signatures_pending = len(self.sessions)

    def start_epoch(self, epoch: int, base_steps: list[int] | None = None) -> None:
        """Every worker runs ``epoch`` (each is READY, or ENDED with the last epoch drained, or
        still RUNNING the last epoch whose batches were all delivered: its end is awaited).
        ``base_steps``: per worker, the epoch's step of its first batch (a resumed epoch)."""
        self.finish_epoch()
        self._arrivals.clear()
        for index, session in enumerate(self.sessions):
            session.received = session.delivered = session.step_offset = 0
            session.base_step = 0 if base_steps is None else base_steps[index]
            session.last_step = None
            if session.state == WorkerState.STARTING:  # a replacement: starts it after Hello
                session.after_start = (WorkerState.RUNNING, epoch)
                session.epoch = epoch
                continue
            session.move(WorkerState.RUNNING, epoch)
            session.handle.send(wire.StartEpoch(epoch))

    def finish_epoch(self) -> None:
        """Wait for the end of the epoch whose batches were all delivered (a trainer that stops
        after ``len(loader)`` batches never asks for the end itself)."""
        for session in self.sessions:
            while session.open_in_epoch and not session.queue:
                self.pump(session, self.wait_limit(session))
            if session.queue:
                raise self._fail(
                    ProtocolError(
                        f"{session.describe()} sent more batches of epoch {session.epoch} than "
                        "its epoch has"
                    )
                )

    def abort_epoch(self, epoch: int) -> None:
        """Stop ``epoch`` everywhere and wait until every worker rebuilt its sources (READY)."""
        for session in self.sessions:
            while session.queue:
                self.release_now(session, session.queue.popleft())
            if session.state == WorkerState.STARTING:
                # a replacement still starting: it rebuilds for the next epoch when it reads
                # this (commands are handled in order), and is READY after its Hello
                session.after_start = (WorkerState.READY, None)
                session.sources_for = (epoch + 1, None)
                session.handle.send(wire.AbortEpoch(epoch))
                continue
            session.move(WorkerState.ABORTING, epoch)
            session.handle.send(wire.AbortEpoch(epoch))
        for session in self.sessions:
            while session.state == WorkerState.ABORTING:
                self.pump(session, self.trace_timeout)  # includes rebuilding the source
        self._expect_signatures()

    def seek(
        self, epoch: int, segments: tuple[tuple[int, tuple[int, ...]], ...], continues: bool
    ) -> list[int]:
        """Every worker rebuilds its sources to start ``epoch`` at a saved position; returns the
        batches each has left in that epoch."""
        self.resume_position = Position(epoch, segments, continues)
        message = wire.Seek(self.resume_position)
        for session in self.sessions:
            session.sources_for = (epoch, self.resume_position)
            session.move(WorkerState.REBUILDING, epoch)
            session.resumed_steps = None
            session.handle.send(message)
        for session in self.sessions:
            # a condition on the session, not one state: a worker that dies while rebuilding
            # is replaced by a process that builds its sources at the position, then says Hello
            while session.state == WorkerState.REBUILDING or (
                session.state == WorkerState.STARTING
                and session.after_start[0] == WorkerState.REBUILDING
            ):
                starting = session.state == WorkerState.STARTING
                self.pump(session, self.wait_limit(session) if starting else self.trace_timeout)
        self._expect_signatures()
        return [s.resumed_steps or 0 for s in self.sessions]

    def wait_signatures(self) -> None:
        """Wait until every worker whose loop traced sent its signature; checks agreement.

        A worker's traced first batch is bounded by ``trace_timeout``; once it delivered a batch,
        the ordinary per-batch ``timeout`` applies to the rest.
        """
        while self._signatures_pending:
            waiting = next(s for s in self.sessions if s.signature_pending)
            self.pump(waiting, self.wait_limit(waiting))

    def next_batch(self, cursor: int) -> tuple[WorkerSession, wire.BatchReady] | None:
        """The next batch in round-robin order from ``cursor``; None when the epoch is over."""
        sessions = self.sessions
        while True:
            chosen = sessions[cursor]
            if not chosen.queue and chosen.state != WorkerState.RUNNING:  # ended, or restarting
                index = choose_worker(
                    cursor, [bool(s.queue) for s in sessions], [s.open_in_epoch for s in sessions]
                )
                if index is None:
                    return None
                chosen = sessions[index]
            if chosen.queue:
                self.flush_releases(lazy=True)
                chosen.delivered += 1
                return chosen, chosen.queue.popleft()
            if chosen.reader.all_held:
                self.flush_releases()
                if chosen.reader.all_held:
                    self.collect_views(chosen)
            # one poll: returns at once when something is waiting, so no receive is tried first
            self.pump(chosen, self.wait_limit(chosen))

    def next_ready_batch(self) -> tuple[WorkerSession, wire.BatchReady] | None:
        """``in_order=False``: the batch that arrived first, from any worker; None when every
        worker's epoch is over. Exactly once as in order; only the interleaving differs."""
        arrivals = self._arrivals
        while True:
            while arrivals:
                chosen = self.sessions[arrivals.popleft()]
                if chosen.queue:  # (a replaced worker's queue was dropped)
                    self.flush_releases(lazy=True)
                    chosen.delivered += 1
                    return chosen, chosen.queue.popleft()
            queued = [s for s in self.sessions if s.queue]
            if queued:  # never wait while a batch is queued (its worker may be out of slots)
                chosen = queued[0]
                self.flush_releases(lazy=True)
                chosen.delivered += 1
                return chosen, chosen.queue.popleft()
            open_sessions = [s for s in self.sessions if s.open_in_epoch]
            if not open_sessions:
                return None
            if all(s.reader.all_held for s in open_sessions):
                self.flush_releases()
                if all(s.reader.all_held for s in open_sessions):
                    self.collect_views(open_sessions[0])
            # waits on every worker; a timeout names the one that is furthest behind
            waiting = min(open_sessions, key=lambda s: s.received)
            self.pump(waiting, self.wait_limit(waiting))

    def wait_limit(self, session: WorkerSession) -> float | None:
        """How long the trainer waits for ``session``'s next record: ``startup_timeout`` while a
        process starts or traces its first batch, else ``timeout``; a replacement, when
        ``timeout`` is set, less (see :meth:`_limit`)."""
        return self._limit(session)[0]

    def _limit(self, session: WorkerSession) -> tuple[float | None, str]:
        """:meth:`wait_limit`, and the setting it comes from, for messages.

        A replacement (``timeout`` set) must not wait ``startup_timeout`` (300 s by default) for
        a worker that hangs again, e.g. on the same sample: its start (spawn, imports, sources;
        nothing loaded yet) gets :data:`REPLACEMENT_START` at most, and its traced first batch
        ``timeout`` plus twice the longest trace this worker took before (what tracing costs
        here, measured: a replacement traces the same loop again), so a hang is seen after
        about ``timeout`` per restart."""
        timeout = self.timeout
        starting = session.state == WorkerState.STARTING
        tracing = session.signature_pending and session.received == 0
        traced = session.counters.trace_seconds
        # a replacement process that has not traced yet (a later trace, after a rebuild, is
        # bounded like any worker's)
        replacement = self._replacements.get(session.index) == (session.handle, len(traced))
        if timeout is not None and replacement and (starting or tracing):
            if not starting and traced:
                extra = round(2 * max(traced), 1)
                return timeout + extra, (
                    f"timeout={timeout:g}, plus {extra:g} s for a replacement to trace again: "
                    "twice its first trace"
                )
            start = min(self.startup_timeout, max(timeout, REPLACEMENT_START))
            return start, f"a replacement's start: at most {start:g} s"
        if starting:
            return self.startup_timeout, f"startup_timeout={self.startup_timeout:g}"
        if tracing:
            limit = self.trace_timeout
            return limit, "" if limit is None else f"startup_timeout={limit:g}"
        return timeout, "" if timeout is None else f"timeout={timeout:g}"

    # ------------------------------------------------------------------------------ healing
    def _hello(self, session: WorkerSession, message: wire.Hello) -> None:
        first = session.hello is None
        session.hello = message
        if first:
            session.move(WorkerState.READY)
            return
        state, epoch = session.after_start  # a replacement: go on where its predecessor was
        if state == WorkerState.RUNNING:
            assert epoch is not None
            session.move(WorkerState.RUNNING, epoch)
            session.handle.send(wire.StartEpoch(epoch))
        else:
            session.move(WorkerState.READY)
            if state == WorkerState.REBUILDING:
                session.resumed_steps = message.first_epoch_steps

    def _samples_failed(self, session: WorkerSession, message: wire.SamplesFailed) -> None:
        """on_error="skip": remember the samples and tell the other workers (each would
        otherwise fail on them in a later epoch, and be replaced for it, or log them again);
        the worker's exit that follows is expected, unless it goes on (``exits=False``: their
        ``load`` raised, or hung). Each sample is logged once, by whoever reported it first."""
        new = [
            (index, name)
            for index, name in zip(message.ids, message.names, strict=True)
            if index not in self.bad_samples
        ]
        # the step counted in this process's epoch (a replacement's, or a resumed one's, starts
        # at 0); a batch of the next epoch (prefetched across the epoch's end) counts from 0
        step = message.step
        if message.epoch == session.epoch:
            step = session.epoch_step(step)
        for index, name in new:
            described = f"sample {index}" if name == str(index) else f"sample {index} ({name})"
            logger.warning(
                "skipped %s: worker %d (%s) fails on it at epoch %d, step %d (%s)",
                described,
                session.index,
                session.shard.describe(),
                message.epoch,
                step,
                message.reason,
            )
        self.bad_samples.update(message.ids)
        if message.exits:
            session.exit_expected = True
        if new:
            found = wire.BadSamples(tuple(index for index, _ in new))
            for other in self.sessions:
                if other is not session:
                    other.handle.send(found)

    def _no_restart_reason(self, session: WorkerSession) -> str | None:
        if self.max_restarts == 0:
            return ""  # the default: fail fast, with today's message
        if self.restarts >= self.max_restarts:
            return f"no restart: the restart budget (max_restarts={self.max_restarts}) is spent"
        if session.hello is None:
            return "no restart: the worker never started, so its source is unknown"
        if session.hello.sampling is None:
            return (
                "no restart: the source cannot start mid-shard (a DALI reader or a plain "
                "ExternalSource); use sharded_files() or sharded_source() to heal"
            )
        if session.state in (WorkerState.FAILED, WorkerState.CLOSED):
            return "no restart: the loader is closing"
        return None

    def _heal_or_fail(self, session: WorkerSession, error: BaseException, cause: str) -> None:
        """Replace ``session``'s worker when allowed; else raise ``error`` (saying why not)."""
        if session.exit_expected:
            session.exit_expected = False
            self._replace(session, "skipped samples that fail inside DALI", budgeted=False)
            return
        reason = self._no_restart_reason(session)
        if reason is None:
            hung: wire.LoadRunning | None = getattr(error, "_hung_load", None)
            if hung is not None and session.handle.spec.on_error == "skip":
                # a sample whose load hangs is skipped like one whose load raises: logged once,
                # the other workers told, and the replacement (a restart: the stuck process
                # is killed) makes its batch without it
                hang = wire.SamplesFailed(
                    hung.epoch,
                    hung.step,
                    (hung.index,),
                    (hung.name,),
                    f"its load() hangs: still running after {hung.seconds:.1f} s",
                    exits=False,
                )
                self._samples_failed(session, hang)
            self._replace(session, cause)
            return
        if reason:
            error.args = (f"{error.args[0]} ({reason})", *error.args[1:])
        raise self._fail(error)

    def _replace(self, session: WorkerSession, cause: str, *, budgeted: bool = True) -> None:
        """A new process for ``session``'s shard, starting at the first batch the trainer has
        not received; batches the old one published and the trainer did not hand out are
        dropped (the new process makes them again), so every sample still arrives once, in
        the same order."""
        if budgeted:
            self.restarts += 1
            session.counters.restarts += 1
        state, epoch = session.state, session.epoch
        shard = session.shard
        # a worker that ended its epoch but whose batches the trainer has not all handed out
        # is replaced like a running one: the new process makes the rest of them again
        going_on = state == WorkerState.RUNNING or (
            state == WorkerState.ENDED and bool(session.queue)
        )
        if going_on or (
            state == WorkerState.STARTING and session.after_start[0] == WorkerState.RUNNING
        ):
            assert epoch is not None
            resumed = self.resume_position
            base = resumed if resumed is not None and resumed.epoch == epoch else None
            count = shard.count
            position = continue_from(base, epoch, count, shard.index, session.delivered)
            session.sources_for = (epoch, position)
            session.after_start = (WorkerState.RUNNING, epoch)
            session.step_offset = session.delivered
            where = f"goes on at batch {session.epoch_step(0)} of epoch {epoch}"
        elif state == WorkerState.REBUILDING:
            session.after_start = (WorkerState.REBUILDING, epoch)
            where = f"resumes epoch {epoch}"
        else:  # READY, ENDED, ABORTING, STARTING: idle between epochs
            if state == WorkerState.ABORTING and epoch is not None:
                session.sources_for = (epoch + 1, None)
            session.after_start = (WorkerState.READY, None)
            where = f"is ready for epoch {session.sources_for[0]}"
        if budgeted:
            logger.warning(
                "worker %d (%s) %s; replaced it with a new process (restart %d of "
                "max_restarts=%d), which %s",
                session.index,
                shard.describe(),
                cause,
                self.restarts,
                self.max_restarts,
                where,
            )
        else:  # a DALI error leaves a process unable to trace again: a fresh one goes on
            logger.info(
                "worker %d (%s) %s; a new process %s", session.index, shard.describe(), cause, where
            )
        spec_epoch, start = session.sources_for
        old = session.handle
        spec = dataclasses.replace(
            old.spec,
            shard=shard.for_epoch(spec_epoch, start),
            bad_samples=frozenset(self.bad_samples),
        )
        session.queue.clear()
        session.reader.close()
        session.reader = SlotReader(spec.num_slots, session.index)
        session.received = 0
        session.last_step = None
        session.handle = self.pool.replace(session.index, spec)
        self._replacements[session.index] = (session.handle, len(session.counters.trace_seconds))
        session.move(WorkerState.STARTING)
        self._poller = None  # type: ignore[assignment]
        if not session.signature_pending:
            session.signature_pending = True
            self._signatures_pending += 1

    # ------------------------------------------------------------------------------ waiting
    def pump(
        self, wanted: WorkerSession | None, timeout: float | None, *, startup: bool = False
    ) -> None:
        """Wait until something arrives, then handle everything that did.

        Raises ``WorkerTimeoutError`` when ``timeout`` passes with nothing from anyone. Anything
        that escapes (a failure, a torn record, an interrupt) closes the pool first.
        """
        try:
            self._pump(wanted, timeout, startup=startup)
        except BaseException as error:
            if self.failure is None:
                self._fail(error)
            raise

    def _pump(self, wanted: WorkerSession | None, timeout: float | None, *, startup: bool) -> None:
        self.releases.waiting = True  # from here, a finalizer on this thread wakes the wait
        try:
            # lazy: releases a worker does not need to go on are held back (see flush_releases)
            self.flush_releases(lazy=True)
            poller, channels, sentinels = self._poller_for_live_sessions()
            started = time.perf_counter_ns()
            ready = poller.poll(None if timeout is None else max(0, int(timeout * 1000)))
            self.wait_ns += time.perf_counter_ns() - started
        finally:
            self.releases.waiting = False
        if not ready:
            assert wanted is not None
            if startup:
                return
            error, cause = self._timeout(wanted, timeout)
            self._heal_or_fail(wanted, error, cause)
            return
        died: list[WorkerSession] = []
        for fd, _events in ready:
            if fd in channels:
                self._drain(channels[fd])
            elif fd in sentinels:
                died.append(sentinels[fd])
            elif fd == self.releases.wakeup_fd:
                self.releases.clear_wakeup()
        for session in died:
            self._drain(session)  # a failure record sent just before exiting explains the exit
            error, cause = self._died(session)
            self._heal_or_fail(session, error, cause)
        self.flush_releases(lazy=True)

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
            for fd in (*channels, *sentinels, self.releases.wakeup_fd):
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
            self.dispatch(session, record)
        if channel.at_eof:
            # The worker is gone or going: from now on only its sentinel is waited on, which
            # fires once the process has exited (no spinning on a readable end of stream).
            session.handle.eof = True
            self._poller = None  # type: ignore[assignment]

    # ------------------------------------------------------------------------------ releases
    def flush_releases(self, *, lazy: bool = False) -> None:
        """Send queued releases, one record per worker.

        ``lazy`` keeps fewer than half a ring of a worker's releases queued while that costs
        nothing: the worker still has a free slot (or a batch on its way), or the trainer still
        holds a batch of it to deliver next. A busy trainer then wakes a blocked worker once per
        half ring rather than once per batch, and a starved one sends one release record per
        half ring (fewer, larger records both ways). A release a worker needs to go on is never
        held back, so waiting on a worker cannot deadlock."""
        pending = self._pending_releases
        if not pending and not self.releases:
            return
        for reader, slot, generation in self.releases.take():
            if self.sessions[reader.owner].reader is not reader:
                continue  # a fill of a replaced process: its slots went with it
            if reader.release(slot, generation):
                pending.setdefault(reader, []).append((slot, generation))
        for reader in list(pending):
            session = self.sessions[reader.owner]
            fills = pending[reader]
            if session.reader is not reader:
                del pending[reader]  # the process was replaced: its slots went with it
                continue
            if (
                lazy
                and len(fills) < max(1, reader.num_slots // 2)
                and (session.queue or reader.held + len(fills) < reader.num_slots)
            ):
                continue
            del pending[reader]
            session.handle.send(wire.Release(tuple(fills)))

    def release_now(self, session: WorkerSession, descriptor: wire.BatchReady) -> None:
        if session.reader.release(descriptor.slot, descriptor.generation):
            session.handle.send(wire.Release(((descriptor.slot, descriptor.generation),)))

    def collect_views(self, session: WorkerSession) -> None:
        """Before declaring every slot held: collect dead views and send their releases."""
        gc.collect()
        self.flush_releases()
        if session.reader.all_held and not session.queue:
            raise self._fail(
                SlotsExhaustedError(
                    f"the trainer holds all {session.reader.num_slots} shared-memory slots of "
                    f"{session.describe()} through live batch views, so it cannot produce the "
                    "next batch. Drop references to old batches (or their arrays/tensors), pass "
                    "copy=True to get private copies, or raise prefetch="
                )
            )

    # ------------------------------------------------------------------------------ messages
    def dispatch(self, session: WorkerSession, message: Any) -> None:
        if isinstance(message, wire.BatchReady):
            self._batch_ready(session, message)
        elif isinstance(message, (wire.ArenaReady, wire.CudaRingReady)):
            session.reader.attach(open_region(message, session.handle.channel, self.stream_of))
        elif isinstance(message, wire.Signature):
            session.signature = message
            session.counters.trace_seconds.append(message.trace_seconds)
            self._signed(session)
        elif isinstance(message, wire.EpochEnd):
            if session.state == WorkerState.RUNNING and session.epoch == message.epoch:
                session.move(WorkerState.ENDED)
                session.sources_for = (message.epoch + 1, None)
            session.counters.traces = message.traces
            session.counters.rebuilds = message.rebuilds
            self._signed(session)
        elif isinstance(message, wire.EpochAborted):
            if session.state == WorkerState.ABORTING and session.epoch == message.epoch:
                session.move(WorkerState.READY)
                session.sources_for = (message.epoch + 1, None)
        elif isinstance(message, wire.Sought):
            if session.state == WorkerState.REBUILDING and session.epoch == message.epoch:
                session.resumed_steps = message.steps
                session.move(WorkerState.READY)
        elif isinstance(message, wire.SamplesFailed):
            self._samples_failed(session, message)
        elif isinstance(message, wire.WorkerFailure):
            raise self._fail(self.relay_failure(session, message))
        elif isinstance(message, wire.WarningRelay):
            self.relay_warning(session, message)
        elif isinstance(message, wire.LogRelay):
            logger.log(message.level, "worker %d: %s", session.index, message.message)
        elif isinstance(message, wire.Hello):
            self._hello(session, message)
        else:
            raise self._fail(
                ProtocolError(
                    f"{session.describe()} sent an unknown record {type(message).__name__}"
                )
            )

    def _batch_ready(self, session: WorkerSession, message: wire.BatchReady) -> None:
        try:
            session.reader.receive(message)
        except ProtocolError as error:
            raise self._fail(ProtocolError(f"{session.describe()}: {error}")) from None
        if session.state != WorkerState.RUNNING or message.epoch != session.epoch:
            self.release_now(session, message)  # a batch of an epoch the trainer left
            return
        if message.step != session.received:
            raise self._fail(
                ProtocolError(
                    f"{session.describe()} sent step {message.step} of epoch {message.epoch}, "
                    f"expected step {session.received}"
                )
            )
        session.queue.append(message)
        if not self.in_order:
            self._arrivals.append(session.index)
        session.received += 1
        session.last_step = message.step
        counters = session.counters
        counters.steps += 1
        counters.bytes += message.nbytes
        counters.blocked_ns += message.blocked_ns
        counters.busy_ns += message.busy_ns

    def _signed(self, session: WorkerSession) -> None:
        if session.signature_pending:
            session.signature_pending = False
            self._signatures_pending -= 1
            if not self._signatures_pending:
                self.check_agreement()

    # ------------------------------------------------------------------------------ agreement
    def check_agreement(self) -> None:
        """Every worker's signature must match worker 0's (or the first one seen)."""
        signed = [s for s in self.sessions if s.signature is not None]
        if not signed:
            return
        reference_session = signed[0]
        reference = reference_session.signature
        assert reference is not None
        expected = reference.agreement_fields()
        for session in signed[1:]:
            assert session.signature is not None
            for field, value in session.signature.agreement_fields().items():
                if value != expected[field]:
                    raise self._fail(
                        AgreementError(
                            f"{session.describe()} disagrees with worker "
                            f"{reference_session.index} on {field}: "
                            f"{_short(value)} != {_short(expected[field])}. Every worker must "
                            "trace the same loop: make source(shard) and step() give the same "
                            "batch size, device and outputs on every shard"
                        )
                    )
        self.reference = reference
        fell_back = [
            s
            for s in signed
            if s.signature and s.signature.capture_requested and not s.signature.captured
        ]
        if fell_back and not self.fallback_warned:
            self.fallback_warned = True
            names = ", ".join(f"{s.index} ({s.shard.describe()})" for s in fell_back)
            warnings.warn(
                f"capture=True was specified but no operators were captured during tracing in "
                f"worker(s) {names}; they run step() eagerly. Make step() call DALI operators "
                "(arithmetic, slicing and ndd.math are not captured), or pass capture=False",
                UserWarning,
                stacklevel=5,
            )

    # ------------------------------------------------------------------------------ failures
    @staticmethod
    def where(session: WorkerSession, epoch: int | None, step: int | None) -> str:
        parts = [f"worker {session.index}", session.shard.describe()]
        parts.append(f"epoch {epoch}" if epoch is not None else "before the first epoch")
        if step is not None:
            parts.append(f"step {step}")
        return ", ".join(parts)

    def relay_failure(self, session: WorkerSession, failure: wire.WorkerFailure) -> BaseException:
        step = failure.step
        if step is not None and failure.epoch == session.epoch:
            step = session.epoch_step(step)  # the epoch's, not this process's
        where = self.where(session, failure.epoch, step)
        message = f"{failure.message} [{where}, in {failure.phase}]"
        for pattern, hint in HINTS:
            if pattern in failure.message:
                message += f" Hint: {hint}"
        error, why_not = _rebuild_exception(failure.type_module, failure.type_name, message)
        if error is None:
            remote = f"{failure.type_module}.{failure.type_name}"
            error = WorkerError(f"{remote}: {message}{why_not}", remote_type=remote)
        for name, value in (
            ("worker", session.index),
            ("shard", session.shard.index),
            ("epoch", failure.epoch),
            ("step", step),
            ("phase", failure.phase),
            ("remote_traceback", failure.traceback),
        ):
            with contextlib.suppress(AttributeError):
                setattr(error, name, value)
        error.__cause__ = RemoteTraceback(failure.traceback)
        return error

    def relay_warning(self, session: WorkerSession, relay: wire.WarningRelay) -> None:
        if NOTHING_CAPTURED in relay.message:
            return  # reported once, for all workers, by check_agreement
        category: type[Warning] = UserWarning
        if relay.category_module == "builtins":
            found = getattr(builtins, relay.category_name, None)
            if isinstance(found, type) and issubclass(found, Warning):
                category = found
        warnings.warn_explicit(
            f"[worker {session.index}] {relay.message}",
            category,
            relay.filename,
            relay.lineno,
            module=f"worker{session.index}",
        )

    def _died(self, session: WorkerSession) -> tuple[BaseException, str]:
        """The error a dead worker raises, and a one-line cause for a restart's log record."""
        handle = session.handle
        handle.process.join(0.5)
        exitcode = handle.process.exitcode
        text, signal_name = describe_exit(exitcode)
        stack = handle.read_stack(0.2)
        handle.exited = True
        last = (
            "no batch yet"
            if session.last_step is None
            else f"last step sent {session.epoch_step(session.last_step)}"
        )
        message = (
            f"{session.describe()} {text} unexpectedly "
            f"[{self.where(session, session.epoch, None)}, {last}]"
        )
        if stack.strip():
            message += f"\n--- worker stack (faulthandler) ---\n{stack.rstrip()}"
        elif session.hello is None and exitcode == 1:
            message += f": {MAIN_GUARD_HINT}"
        error = WorkerDiedError(
            message,
            worker=session.index,
            pid=handle.pid,
            exitcode=exitcode,
            signal_name=signal_name,
        )
        cause = f"{text}" + (f"; its stack: {_top_frames(stack)}" if stack.strip() else "")
        return error, cause

    def _timeout(self, session: WorkerSession, timeout: float | None) -> tuple[BaseException, str]:
        """The error a stuck worker raises (its stack read first), and a cause for the log."""
        handle = session.handle
        stack = ""
        if handle.pid is not None and not handle.exited:
            try:
                os.kill(handle.pid, signal.SIGUSR1)
                stack = handle.read_stack(1.5)
            except (ProcessLookupError, OSError):
                stack = ""
        assert timeout is not None  # (a wait without a limit does not time out)
        waiting_for = "its first batch" if session.received == 0 else "a batch"
        limit, setting = self._limit(session)
        if limit != timeout:  # a wait of its own (a rebuild, a resume)
            knobs = {self.timeout: "timeout", self.startup_timeout: "startup_timeout"}
            setting = f"{knobs[timeout]}={timeout:g}" if timeout in knobs else f"{timeout:g} s"
        step = session.epoch_step(session.next_step)  # the epoch's, not this process's
        # the sample a load has been stuck on since (about) the wait began hangs; a load that
        # started later is merely the one running when the wait, for a slow batch, ran out
        running = wire.LoadRunning.find(stack)
        hung = running if running is not None and running.seconds >= timeout / 2 else None
        hangs = ""
        if hung is not None:
            named = (
                f"sample {hung.index}"
                if hung.name == str(hung.index)
                else f"sample {hung.index} ({hung.name})"
            )
            hangs = f"; its load() hangs on {named} (running for {hung.seconds:.1f} s)"
        message = (
            f"{session.describe()} sent nothing for {timeout:g} s while the trainer waited for "
            f"{waiting_for} ({setting}) [{self.where(session, session.epoch, step)}]{hangs}"
        )
        message += (
            f"\n--- worker stack (faulthandler) ---\n{stack.rstrip()}"
            if stack.strip()
            else "\n(the worker's stack could not be read)"
        )
        error = WorkerTimeoutError(message, worker=session.index, stack=stack)
        error.step = step
        error.epoch = session.epoch
        error._hung_load = hung  # type: ignore[attr-defined]  # (for _heal_or_fail)
        cause = f"sent nothing for {timeout:g} s ({setting}){hangs}"
        if stack.strip():
            cause += f"; stuck in: {_top_frames(stack)}"
        return error, cause

    def _fail(self, error: BaseException) -> BaseException:
        """Record the failure and stop the pool; returns the error for the caller to raise."""
        if self.failure is None:
            self.failure = error
        for session in self.sessions:
            session.move(WorkerState.FAILED)
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
            if session.state != WorkerState.FAILED:
                session.move(WorkerState.CLOSED)
        self.pool.close()
        self.releases.close()


def _rebuild_exception(
    module_name: str, type_name: str, message: str
) -> tuple[BaseException | None, str]:
    """The worker's exception as the same class in the trainer, when the trainer knows it.

    Builtins and the loader's own errors always; a user's class when its module is already
    imported in the trainer (a class of the main script arrives as ``__mp_main__`` and is looked
    up in ``__main__``). Returns ``(None, why)`` when it cannot be re-created.
    """
    known = KNOWN_TYPES.get((module_name, type_name))
    if known is not None:
        return known(message), ""
    if module_name == "builtins":
        module: Any = builtins
    else:
        module = sys.modules.get("__main__" if module_name == "__mp_main__" else module_name)
        if module is None:
            return None, (
                f" (the trainer has not imported {module_name!r}, so the exception arrives as "
                "WorkerError; import that module in the trainer to catch its class)"
            )
    kind: Any = module
    for part in type_name.split("."):
        kind = getattr(kind, part, None)
    if not (isinstance(kind, type) and issubclass(kind, Exception)):
        return None, f" (the trainer's {module_name} has no exception class {type_name})"
    try:
        return kind(message), ""
    except Exception:
        return None, (
            f" ({module_name}.{type_name} cannot be re-created from a message alone, so it "
            "arrives as WorkerError)"
        )


def _top_frames(stack: str, count: int = 3) -> str:
    """The innermost frames where the worker is stuck, on one line, from a faulthandler dump:
    the thread inside a sample's ``load`` when there is one (samples are loaded on a prefetch
    thread), else the thread that took the signal (the main thread, where the loop runs)."""
    blocks: list[tuple[str, list[str]]] = []
    for line in stack.strip().splitlines():
        if line.startswith(("Thread ", "Current thread ")):
            blocks.append((line, []))
        elif line.strip().startswith("File ") and blocks:
            blocks[-1][1].append(line.strip())
    loading = [frames for _, frames in blocks if any(" in _load" in f for f in frames)]
    current = [frames for header, frames in blocks if header.startswith("Current thread")]
    frames = (loading or current or [frames for _, frames in blocks[-1:]] or [[]])[0]
    return " <- ".join(frames[:count]) or stack.strip()[-200:]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 300 else text[:297] + "..."
