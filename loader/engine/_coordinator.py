"""The coordinator: the trainer's event loop over every worker. Runs in the trainer.

It owns one layout's engine and is what the run calls: the lifecycle commands (start the
workers, start an epoch, finish or abort it, seek), the next batch in the loader's order
(:mod:`loader.engine._order`; a skipped batch is judged by :mod:`loader.engine._healing`, a
trainer that holds every slot is told so), the queries on the workers (sampling, steps, epochs,
random states, stats), and failing and closing the pool. The parts it is made of:

* :mod:`loader.engine._roster`: every worker's session (:mod:`loader.engine._session`), and the
  one way records go to workers;
* :mod:`loader.engine._waiting`: the one wait on every worker, which replaces a dead or stuck one
  (or raises);
* :mod:`loader.engine._routing`: each record to its session and the policy it concerns;
* :mod:`loader.engine._agreement`: whether every worker traced the same loop.

A wait only reports what happened; lifecycle commands are "send, then wait until a condition on
the sessions holds", so a worker replaced in the middle of a command is covered by the same
condition.

Invariants: only the trainer's thread that iterates calls into it; a failure closes the pool
before the exception leaves, so nothing is left running behind an error (what the wait raises
too: :meth:`Coordinator._wait` fails the pool first). The one exception that leaves with the pool
up is an interruption (Ctrl-C) of a batch wait while it was blocked, which left every session as
it was (:mod:`loader.engine._interrupts`): the run asks :meth:`Coordinator.interrupted_cleanly`.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ipc import ProtocolError, SlotReader, wire
from ipc.wire import Position, Sampling

from ..errors import SlotsExhaustedError
from ..processes import WorkerPool
from . import _failures, _interrupts
from ._agreement import Agreement
from ._healing import Healing
from ._order import ArrivalOrder, InOrder, Take
from ._releases import Releases
from ._roster import Roster
from ._routing import Router
from ._session import Delivery, Idle, SessionView, Stopped, WorkerSession, WorkerState
from ._stats import LoaderStats, Timeline, TrainerCounters, snapshot
from ._waiting import Limit, Waiter


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
        self.releases = Releases()
        self.roster = Roster(self.releases)
        self.agreement = Agreement()
        router = Router(self.roster, healing, self.agreement, self.order, self.timeline, stream_of)
        self._waiter = Waiter(self.roster, pool, healing, router, self.agreement)
        self.failure: BaseException | None = None
        #: what :attr:`failure` was, in words (never empty once there is a failure)
        self.failure_reason = ""
        #: an interruption a batch wait let through with the pool up (until the run asks)
        self._clean_interrupt: BaseException | None = None
        #: the epoch the workers were ready for when a failure stopped them (see next_epoch)
        self._next_epoch_at_stop: int | None = None
        self._closed = False

    @property
    def sessions(self) -> list[WorkerSession]:
        """Every worker's session, in worker order (the roster's)."""
        return self.roster.sessions

    @property
    def reference(self) -> wire.Signature | None:
        """The signature every worker agrees on (None before one arrived)."""
        return self.agreement.reference

    @property
    def interrupted(self) -> bool:
        """The pool was stopped by an interruption (Ctrl-C) that was not clean: the sessions
        still say what was handed out (``state_dict()`` reads them)."""
        return self.failure is not None and _interrupts.is_interruption(self.failure)

    @property
    def wait_ns(self) -> int:
        """Time the trainer spent waiting on its workers, over the pool's life."""
        return self._waiter.wait_ns

    # ------------------------------------------------------------------------------ lifecycle
    def start(self, timeout: float) -> None:
        """Start every worker (all before waiting for any), then wait until each said Hello.
        ``timeout`` (``startup_timeout``) runs from each worker's last record: one that tells
        what it does (``wire.Starting``: a scan of shards without an index) is alive; one
        silent that long fails, named with what it last said it does."""
        self.pool.start()
        self.roster.open(self.pool.handles)
        self.timeline.ensure(len(self.sessions))
        while starting := [s.view() for s in self.sessions if not s.up]:
            late = min(starting, key=lambda v: v.heard_at)
            remaining = late.heard_at + timeout - time.monotonic()
            if remaining <= 0:
                raise self._fail(_failures.not_started(late, timeout))
            wanted = self.sessions[late.index]
            self._wait(wanted, (remaining, ""), "the workers were starting", startup=True)
        self.agreement.expect(self.sessions)

    def start_epoch(self, epoch: int, base_steps: list[int] | None = None, cursor: int = 0) -> None:
        """Every worker runs ``epoch`` (a process still starting is told after its Hello); the
        last epoch, if all its batches were delivered, is awaited first. ``base_steps``: per
        worker, the epoch's step of its first batch (a resumed epoch); ``cursor``: the worker
        whose turn is first."""
        self.finish_epoch()
        self.order.start(cursor)
        for index, session in enumerate(self.sessions):
            base_step = 0 if base_steps is None else base_steps[index]
            self.roster.send(session, session.start_epoch(epoch, base_step))

    def finish_epoch(self) -> None:
        """Wait for the end of the epoch whose batches were all delivered (a trainer that stops
        after ``len(loader)`` batches never asks for the end itself)."""
        self._until(
            lambda s: s.queued > 0 or not s.open_in_epoch,
            self.healing.wait_limit,
            "waiting for the end of the epoch",
        )
        extra = next((s for s in self.sessions if s.queued), None)
        if extra is not None:
            raise self._fail(
                ProtocolError(
                    f"{extra.describe()} sent more batches of epoch {extra.view().epoch} than its "
                    "epoch has"
                )
            )

    def abort_epoch(self, epoch: int) -> None:
        """Stop ``epoch`` everywhere and wait until every worker rebuilt its sources for the
        next one (a process still starting does it after its Hello: commands go in order)."""
        for session in self.sessions:
            for descriptor in session.take_queued():
                self.roster.release(session, descriptor)
            if not isinstance(session.view().target, Idle):
                self.roster.send(session, session.abort_epoch(epoch))
        self._until(_idle, self._command_limit, f"the workers were leaving epoch {epoch}")
        self.agreement.expect(self.sessions)

    def seek(self, position: Position, random: list[wire.RandomStates] | None = None) -> list[int]:
        """Every worker rebuilds its sources to start ``position.epoch`` at ``position`` (with
        ``random[worker]``, its random generators in those states); returns the batches each
        has left in that epoch."""
        self.finish_epoch()  # (an epoch over by count: its end is on its way)
        for index, session in enumerate(self.sessions):
            states = b"" if random is None else random[index]
            self.roster.send(session, session.seek(position, states))
        self._until(_idle, self._command_limit, f"the workers were seeking epoch {position.epoch}")
        self.agreement.expect(self.sessions)
        return [s.view().resumed_steps or 0 for s in self.sessions]

    def wait_signatures(self) -> None:
        """Wait until every worker whose loop traced sent its signature; checks agreement.

        A worker's traced first batch is bounded by ``startup_timeout`` (with ``timeout`` set);
        once it delivered a batch, the ordinary per-batch ``timeout`` applies to the rest."""
        self._until(
            lambda s: not s.signature_pending,
            self.healing.wait_limit,
            "waiting for the workers' first (traced) batches",
            resumable=True,
        )

    def _until(
        self,
        done: Callable[[WorkerSession], bool],
        limit: Callable[[SessionView], Limit],
        doing: str,
        *,
        resumable: bool = False,
    ) -> None:
        """Wait until ``done`` holds for every session, re-checked after everything that
        arrives (a worker replaced meanwhile is judged by its new process). ``doing``: the
        words for an interruption; ``resumable``: see :meth:`_wait`."""
        while (waiting := next((s for s in self.sessions if not done(s)), None)) is not None:
            self._wait(waiting, limit(waiting.view()), doing, resumable=resumable)

    def _command_limit(self, view: SessionView) -> Limit:
        """A command's answer includes rebuilding the sources: the trace's limit."""
        if not view.up:
            return self.healing.wait_limit(view)
        trace = self.healing.timeouts.trace
        return trace, "" if trace is None else f"startup_timeout={trace:g}"

    # ------------------------------------------------------------------------------ batches
    def next_batch(self, step: int) -> Delivery | None:
        """The next batch in the loader's order, the rank's ``step`` of the epoch (what
        ``batch.info.step`` says); None when every worker's epoch is over."""
        while True:
            decision = self.order.choose(self.sessions)
            if decision is None:
                return None
            if isinstance(decision, Take):
                self.roster.send_releases(lazy=True)
                return self._deliver(self.sessions[decision.worker], step)
            blocked = [self.sessions[index] for index in decision.blocked]
            if all(s.reader.all_held for s in blocked):
                self.roster.send_releases(lazy=False)
                if all(s.reader.all_held for s in blocked):
                    self._collect_views(blocked[0])
            waiting = self.sessions[decision.worker]
            doing = f"waiting for batch {step} ({waiting.describe()})"
            self._wait(waiting, self.healing.wait_limit(waiting.view()), doing, resumable=True)

    def _deliver(self, session: WorkerSession, step: int) -> Delivery:
        descriptor = session.peek()
        if descriptor.skipped:  # (checked before any view of the slot is made)
            sampling = self.sampling()
            error = self.healing.delivered(descriptor, 0 if sampling is None else sampling.total)
            if error is not None:
                raise self._fail(error)
        return session.deliver(step)

    def handed_out(self, delivery: Delivery) -> None:
        """``delivery`` reached the user: counted as received (the run's last step)."""
        self.sessions[delivery.info.worker].handed_out(delivery.descriptor)

    def take_back(self, delivery: Delivery) -> None:
        """``delivery`` did not reach the user after all (an interruption stopped ``next()``
        before it returned): not counted, whether :meth:`handed_out` had counted it or not."""
        session = self.sessions[delivery.info.worker]
        if session.reader is delivery.reader:
            session.take_back(delivery.descriptor)

    def release_at_once(self, worker: int, reader: SlotReader, descriptor: wire.BatchReady) -> None:
        """The batch is a private copy (``copy=True``): its slot goes back now."""
        session = self.sessions[worker]
        if session.reader is reader:
            self.roster.release(session, descriptor)

    def output_kind(self, worker: int) -> str:
        signature = self.reference or self.sessions[worker].signature
        return signature.output_kind if signature is not None else "dict"

    def _collect_views(self, session: WorkerSession) -> None:
        """Before declaring every slot held: collect dead views and send their releases."""
        gc.collect()
        self.roster.send_releases(lazy=False)
        if session.reader.all_held and not session.queued:
            raise self._fail(
                SlotsExhaustedError(
                    f"the trainer holds all {session.reader.num_slots} shared-memory slots of "
                    f"{session.describe()} through live batch views, so it cannot produce the "
                    "next batch. Drop references to old batches (or their arrays/tensors), pass "
                    "copy=True to get private copies, or raise prefetch (now "
                    f"{session.reader.num_slots - 2}: a worker has prefetch + 2 slots)"
                )
            )

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
        workers differ, which a seek settles). After a failure: as it was when the pool
        stopped (what ``state_dict()`` needs after an interruption)."""
        if self.failure is not None:
            return self._next_epoch_at_stop
        epochs = {s.next_epoch for s in self.sessions}
        return next(iter(epochs)) if len(epochs) == 1 else None

    def worker_facts(self) -> tuple[WorkerFacts, ...]:
        """A snapshot of every worker, for tuning."""
        views = [s.view() for s in self.sessions]
        return tuple(WorkerFacts(v.handle.pid, v.counters.bytes, v.counters.steps) for v in views)

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
            f"worker {v.index} (shard {v.shard.index}/{v.shard.count}, pid {v.handle.pid})"
            for v in (s.view() for s in self.sessions)
        ]

    def delivered(self) -> list[int]:
        """Per worker, the batches of the epoch in progress handed to the user."""
        return [s.view().delivered for s in self.sessions]

    def random_states(self) -> list[wire.RandomStates]:
        """Per worker, the random generator states of its first batch not yet delivered."""
        return [s.view().random for s in self.sessions]

    def pids(self) -> list[int]:
        return [s.handle.pid for s in self.sessions if s.handle.pid is not None]

    def stats(self, trainer: TrainerCounters, window: float = 10.0, cpus: int = 1) -> LoaderStats:
        healing = self.healing
        return snapshot(
            [s.view() for s in self.sessions],
            trainer,
            now=time.monotonic(),
            wait_ns=self.wait_ns,
            skipped=healing.skipped,
            restarts=healing.restarts,
            found_left_out=tuple(healing.left_out.values()),
            timeline=self.timeline,
            window=window,
            cpus=cpus,
        )

    # ------------------------------------------------------------------------------ the wait
    def _wait(
        self,
        wanted: WorkerSession,
        limit: Limit,
        doing: str,
        *,
        startup: bool = False,
        resumable: bool = False,
    ) -> None:
        """Wait until something arrives, then handle everything that did (see
        :class:`~loader.engine._waiting.Waiter`). Anything that escapes (a failure, a torn
        record, an interrupt) closes the pool first, but for an interruption of a
        ``resumable`` wait (the run's waits for a batch) while it was blocked: it left every
        session as it was, so it goes through with the pool up (:meth:`interrupted_cleanly`).
        ``doing``: what the trainer was waiting for, in the words of an interruption."""
        self._clean_interrupt = None
        try:
            self._waiter.wait(wanted, limit, startup)
        except BaseException as error:
            blocked = self._waiter.blocked
            if resumable and blocked and _interrupts.is_interruption(error):
                self._clean_interrupt = error
            elif self.failure is None:
                self._fail(error, doing if blocked else f"{doing}, handling what the workers sent")
            raise

    def interrupted_cleanly(self, error: BaseException) -> bool:
        """Whether ``error`` is an interruption that a batch wait let through with every
        session as it was (the pool up). Asked once, by the run that caught it."""
        clean, self._clean_interrupt = self._clean_interrupt is error, None
        return clean

    # ------------------------------------------------------------------------------ failing
    def fail(self, error: BaseException, doing: str = "") -> BaseException:
        """Record a failure found outside the loop (across ranks; the run's interruptions)."""
        return self._fail(error, doing)

    def _fail(self, error: BaseException, doing: str = "") -> BaseException:
        """Record the failure and stop the pool; returns the error for the caller to raise."""
        if self.failure is None:
            self._next_epoch_at_stop = self.next_epoch()
            self.failure_reason = _interrupts.reason(error, doing)
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
            session.close()
        self.pool.close()
        self.releases.close()


def _idle(session: WorkerSession) -> bool:
    return session.state is WorkerState.READY
