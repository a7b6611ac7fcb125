"""The worker's command loop and its epochs. Runs in the worker.

:class:`Worker` answers the trainer's commands and runs each epoch's steps; the parts it drives
live beside it: its phase, epoch and step (:class:`~._phase.Activity`), the capture loops
(:mod:`._capture_loops`), the search of a failed batch for its failing samples
(:mod:`._isolation`), the random generators (:mod:`._random`), and from
:mod:`workers.transport`: the epoch's signature (:mod:`~workers.transport._signature`), the failure
record (:mod:`~workers.transport._error_text`, :mod:`~workers.spec._error_context`) and
publishing (:mod:`~workers.transport._publish`).

A capture loop runs one epoch, or, over a ``sharded_source``/``sharded_files`` root without
feeders, every epoch in turn: the worker then ends each epoch by its known step count, and DALI's
prefetch goes on into the next epoch between them (see :mod:`workers.capture._capture_loops`).

Invariants:

* Everything DALI happens on the process's main thread: one EvalContext for the worker's whole
  life (rule 8), at most one capture loop at a time, always on that thread (rule 10).
* The control channel is read and written by the main thread only.
* The worker owns its control state (``Worker.control``: ``on_error`` and the samples known to
  fail, for the process's life; ``Sources.feed``: the batches in flight, per built source) and
  hands it to a sharded source (:mod:`workers.sources.plan._control`); only the main thread
  writes it.
* DALI's random generators are set only right after the sources are built, before any loop over
  them (``Worker.random``, :mod:`._random`); every batch carries their states after its step.
* A slot is written only between acquiring it and publishing it; the worker never touches a
  published slot until the trainer's ``Release`` for that exact generation arrives.
* Every exception becomes one ``WorkerFailure`` record, in order after the batches already sent;
  the worker then stops. A dead trainer (closed channel) ends the worker silently.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from ipc import ChannelClosed, ControlChannel, wire
from ipc.wire import Position

from .. import dali, startup
from ..sources import REPORT_PROGRESS, LoadSkip, SampleControl, reads_so_far
from ..spec import Shard, WorkerSpec
from ..transport import BatchClock, Publisher, Signature, failure, normalize_outputs
from ._capture_loops import CaptureLoops
from ._isolation import FailingSamples, can_isolate
from ._native_lines import NativeLines
from ._phase import STARTING_DOING, Activity, Phase
from ._random import RandomGenerators
from ._sources import Sources, build_sources, delivery_info

logger = logging.getLogger("workers")


class AbortRequested(Exception):
    """The trainer asked to stop the current epoch."""


class ShutdownRequested(Exception):
    """The trainer asked the worker to exit."""


class Stop(Exception):
    """A failure was reported; the worker must exit."""


def _nothing() -> None:
    """Nothing held to send (a worker outside a worker process)."""


class Worker:
    """The state of one worker process; see the module docstring for its invariants."""

    def __init__(self, spec: WorkerSpec, channel: ControlChannel) -> None:
        self.spec = spec
        self.channel = channel
        self.shard = spec.shard
        self.ctx: Any = None
        self.sources: Sources | None = None
        self.publisher: Publisher | None = None
        #: the phase, the epoch and step (between epochs: None) and the epochs' counts
        self.activity = Activity()
        #: each epoch's capture loop, and the one kept across epochs (``continuous`` sources)
        self.loops = CaptureLoops(spec)
        #: on_error and the samples known to fail (replaced without loading), for every source
        self.control = SampleControl(spec.on_error, spec.bad_samples, self.report_skipped)
        #: DALI's random generators: their states after each step, restored at a resume
        self.random = RandomGenerators()
        #: the stage times of each batch (sent with it)
        self.clock = BatchClock()
        #: DALI's native log lines on stderr, held until their batch's outcome is known (the
        #: process setup opens and closes it: :mod:`._native_lines`)
        self.native_lines = NativeLines()
        #: sends what the process's other threads logged or warned (the process's log relay
        #: sets it; the channel is this thread's): after each batch and before each wait
        self.relay_held: Callable[[], None] = _nothing

    # ----------------------------------------------------------------------- start
    def start(self) -> None:
        """Make the EvalContext and the publisher, build the sources, say Hello (the trainer is
        told each phase of it before: :meth:`set_phase`)."""
        self.set_phase(Phase.STARTUP)
        self.ctx = dali.make_context(self.spec.num_threads, self.spec.device_id)
        self.publisher = Publisher(self.spec, self.channel, self.ctx, self.wait_for_trainer)
        # epoch 0 from its start, or (a replacement) where its predecessor stopped, its random
        # generators as they were at that batch
        begun = startup.started_ns()
        if begun is not None:
            startup.record("worker start", begun, time.perf_counter_ns())
        with startup.span("sources"):
            sources = self.build(self.shard, self.spec.random)
        self.activity.idle()
        self.channel.send(
            wire.Hello(
                os.getpid(),
                self.spec.num_threads,
                self.spec.device_id,
                sources.steps_per_epoch,
                sources.sampling(),
                sources.first_epoch_steps,
                () if sources.sampled is None else sources.sampled.left_out,
                startup.spans(),
            )
        )

    def build(self, shard: Shard, random: wire.RandomStates) -> Sources:
        """The sources of ``shard``, the random generators seeded for it or, when given, in the
        states ``random`` (no capture loop is live here: DALI allows it)."""
        reporting = REPORT_PROGRESS.set(self.report_progress)
        try:
            self.sources = build_sources(self.spec, shard, self.set_phase, self.control)
        finally:
            REPORT_PROGRESS.reset(reporting)
        self.clock.follow(self.sources.sampled)
        self.random.rebuilt(random)
        return self.sources

    def set_phase(self, phase: Phase) -> None:
        """Enter ``phase`` of building the sources, and tell the trainer (``wire.Starting``:
        the trainer names it should the worker fall silent)."""
        self.activity.set_phase(phase)
        self.report_progress(STARTING_DOING.get(phase, phase.value))

    def report_progress(
        self, doing: str, done: int = 0, total: int = 0, seconds: float = 0.0
    ) -> None:
        """Tell the trainer what a long part of building the sources does (a source's scan of
        shards without an index: :data:`workers.sources.REPORT_PROGRESS`); main thread only."""
        record = wire.Starting(self.activity.phase.value, doing, done, total, seconds)
        with contextlib.suppress(ChannelClosed, OSError):
            self.channel.send(record)

    def rebuild_sources(
        self,
        epoch: int,
        reason: str,
        position: Position | None = None,
        random: wire.RandomStates = b"",
    ) -> Sources:
        """Sources for ``epoch`` (from ``position``), the random generators seeded for it or,
        when given, in the states ``random``."""
        disabled = self.sources is not None and dali.is_disabled(self.sources.source)
        self.loops.drop()
        self.sources = None
        gc.collect()  # lets DALI shut the torn-down pipeline's threads down now
        sources = self.build(self.shard.for_epoch(epoch, position), random)
        self.activity.rebuilt()
        logger.info(
            "worker %d (%s) rebuilt its source for epoch %d: %s%s",
            self.shard.worker,
            self.shard.describe(),
            epoch,
            reason,
            " (DALI had disabled the reader)" if disabled else "",
        )
        return sources

    # ----------------------------------------------------------------------- messages
    def handle(self, message: Any, *, in_epoch: bool) -> None:
        assert self.publisher is not None
        if isinstance(message, wire.Release):
            self.publisher.release(message.fills)
        elif isinstance(message, wire.AbortEpoch):
            if in_epoch:
                raise AbortRequested
            self.abort_idle(message.epoch)
        elif isinstance(message, wire.CudaFreeEvents):
            self.publisher.set_free_events(message.arena_id, message.handles)
        elif isinstance(message, wire.Shutdown):
            raise ShutdownRequested
        elif isinstance(message, wire.BadSamples):
            self.control.add_bad(message.ids)  # the set the sources replace from
        elif isinstance(message, wire.Seek):
            if in_epoch:
                raise wire.ProtocolError("Seek during an epoch")
            self.seek(message)
        elif isinstance(message, wire.StartEpoch):
            if in_epoch:
                raise wire.ProtocolError("StartEpoch during an epoch")
            self.run_epoch(message.epoch)
        else:
            raise wire.ProtocolError(f"unexpected record {type(message).__name__}")

    def seek(self, message: wire.Seek) -> None:
        """Rebuild the sources to start ``message.epoch`` at a saved position."""
        position = message.position
        reason = "the trainer resumes from a saved position"
        sources = self.rebuild_sources(position.epoch, reason, position, message.random)
        steps = sources.first_epoch_steps
        self.channel.send(wire.Sought(position.epoch, -1 if steps is None else steps))

    def wait_for_trainer(self) -> None:
        """Handle one record from the trainer, inside an epoch (while blocked on slots)."""
        self.handle(self.channel.recv(), in_epoch=True)

    def abort_idle(self, epoch: int) -> None:
        self.rebuild_sources(epoch + 1, f"the trainer left epoch {epoch} early")
        self.channel.send(wire.EpochAborted(epoch, rebuilt=True))

    def drain(self) -> None:
        while self.channel.ready():
            self.handle(self.channel.recv(), in_epoch=True)

    def relay_with(self, send_held: Callable[[], None]) -> None:
        """Have ``send_held`` called after each batch and before each wait for a command: it
        sends what the process's other threads logged or warned (the channel is this
        thread's)."""
        self.relay_held = send_held

    def serve(self) -> None:
        """Answer commands until Shutdown, a failure, or the trainer going away."""
        clock = self.clock
        while True:
            self.relay_held()  # (what other threads logged, before the wait)
            waited = time.perf_counter_ns()
            message = self.channel.recv()
            clock.idle(time.perf_counter_ns() - waited)
            try:
                self.handle(message, in_epoch=False)
            except ShutdownRequested:
                return

    # ----------------------------------------------------------------------- epochs
    def run_epoch(self, epoch: int) -> None:
        sources, activity, loops = self.sources, self.activity, self.loops
        assert sources is not None and self.publisher is not None
        activity.begin(epoch)
        tracing = dali.will_trace(sources.source, self.spec.capture)
        signature = Signature(activity.signature_due(tracing), self.spec, sources.source)
        iterator: Iterator[Any] | None = None
        try:
            steps = loops.epoch_steps(sources, epoch, tracing)  # None: ends with the source
            sources.feed.at_next_pull(None)  # (an aborted epoch's signature is not sent)
            iterator = loops.open(sources, self.ctx, epoch, steps is not None)
            self.run_steps(epoch, steps, iterator, tracing, signature)
            self.send_signature(signature)
        except AbortRequested:
            loops.close(iterator)
            self.abort_idle(epoch)
            activity.leave()
            return
        except (ShutdownRequested, ChannelClosed, Stop):
            loops.close(iterator)
            raise
        except Exception as error:
            self.report(error)
            loops.close(iterator)
            raise Stop from error
        self.channel.send(activity.ended())
        activity.leave()

    def run_steps(
        self,
        epoch: int,
        steps: int | None,
        iterator: Iterator[Any],
        tracing: bool,
        signature: Signature,
    ) -> None:
        """The epoch's steps, until ``steps`` or the source's end; a failing sample is isolated
        (and skipped or named) where the settings allow."""
        clock, step = self.clock, 0
        step_started = clock.begin()
        while steps is None or step < steps:
            try:
                if not self.run_step(
                    epoch, step, steps, iterator, tracing, signature, step_started
                ):
                    break
            except (AbortRequested, ShutdownRequested, ChannelClosed, Stop, wire.ProtocolError):
                raise
            except Exception as error:
                if not can_isolate(error, self.sources, self.activity.phase):
                    raise
                self.loops.close(iterator)
                self.skip_failing_samples(error, epoch, step)  # raises
            step += 1
            self.activity.stepped(step)
            self.drain()
            step_started = clock.begin()

    def run_step(
        self,
        epoch: int,
        step: int,
        steps: int | None,
        iterator: Iterator[Any],
        tracing: bool,
        signature: Signature,
        step_started: int,
    ) -> bool:
        """One step: the source's next inputs, ``step``, the batch published. False when the
        source ended (an epoch that ends with its source)."""
        sources, publisher, activity = self.sources, self.publisher, self.activity
        assert sources is not None and publisher is not None
        activity.set_phase(Phase.DALI)
        try:
            inputs = next(iterator)
        except StopIteration:
            if steps is not None:  # a continuous source never ends
                raise wire.ProtocolError(
                    f"the source ended after {step} of {steps} batches"
                ) from None
            return False
        if tracing and step == 0:  # an epoch without batches traces nothing
            activity.traced()
        if step == 1:  # after the traced step
            self.send_signature(signature)
        activity.set_phase(Phase.STEP)
        outputs = self.spec.call_step(inputs, sources.feeders)
        random = self.random.after_step()  # (DALI draws when an operator is called)
        activity.set_phase(Phase.TRANSPORT)
        named, kind = normalize_outputs(outputs)
        signature.outputs(named, kind)
        padded, replaced, skipped, names, defaulted = delivery_info(
            sources, step, signature.batch_size
        )
        publisher.publish(
            epoch,
            step,
            named,
            step_started,
            padded,
            replaced,
            skipped,
            names,
            random,
            self.clock,
            defaulted,
            reads_so_far(epoch),
        )
        self.native_lines.batch_done()
        self.relay_held()
        if step == 0 and tracing:  # (sent once DALI built the pipeline: see _signature.py)
            sources.feed.at_next_pull(functools.partial(self.send_signature, signature))
        return True

    def send_signature(self, signature: Signature) -> None:
        """Send the epoch's signature when it is due (once)."""
        if (record := signature.take()) is not None:
            self.channel.send(record)

    # ----------------------------------------------------------------------- bad samples
    def skip_failing_samples(self, error: BaseException, epoch: int, done: int) -> None:
        """After batch ``done`` of ``epoch`` failed: find its failing samples. With
        ``on_error="skip"`` tell the trainer which they are and end this process: the trainer
        starts a new one at that batch with them replaced. Otherwise, or when no sample fails
        alone, raise ``error``, its message naming them first (:mod:`._isolation`)."""
        sources = self.sources
        assert sources is not None and sources.sampled is not None
        search = FailingSamples(self.spec, self.ctx, sources.sampled, self.shard.worker)
        record = search.outcome(error, epoch, done)  # (or raises error)
        self.native_lines.drop(search.printed, record.names)  # the trainer's line names them
        self.native_lines.release()  # (the rest: this process ends)
        self.channel.send(record)
        raise Stop

    def report_skipped(self, epoch: int, step: int, name: str, skip: LoadSkip) -> None:
        """on_error="skip": sample ``skip.index``'s ``load`` raised, so batch ``step`` of
        ``epoch`` was made without it. The trainer logs it (once, whichever worker reports it
        first) and tells the other workers, which then replace it without loading it; this one
        goes on."""
        with contextlib.suppress(ChannelClosed, OSError):
            self.channel.send(
                wire.SamplesFailed(
                    epoch,
                    step,
                    (skip.index,),
                    (name,),
                    skip.reason,
                    exits=False,
                    kind=skip.kind,
                    member=skip.member,
                    left_out=skip.left_out,
                )
            )

    def load_in_progress(self) -> wire.LoadRunning | None:
        """The sample whose ``load`` runs now (on the prefetch thread), and for how long; for
        the trainer, which asks for the stack of a worker that sent nothing for too long."""
        sampled = None if self.sources is None else self.sources.sampled
        return None if sampled is None else sampled.load_in_progress()

    # ----------------------------------------------------------------------- errors
    def report(self, error: BaseException) -> None:
        """Send ``error``'s ``WorkerFailure`` record (:func:`workers.transport.failure`)."""
        activity = self.activity
        self.native_lines.release()  # DALI's own lines of it, before the trainer raises
        with contextlib.suppress(ChannelClosed, OSError):
            self.channel.send(
                failure(error, phase=activity.phase.value, epoch=activity.epoch, step=activity.step)
            )

    def close(self) -> None:
        self.loops.drop()
        self.sources = None
        self.random.close()
        if self.publisher is not None:
            self.publisher.close()
        self.channel.close()
