"""The worker's command loop and its epochs. Runs in the worker.

A capture loop runs one epoch, or, over a ``sharded_source``/``sharded_files`` root without
feeders, every epoch in turn: the worker then ends each epoch by its known step count, and DALI's
prefetch goes on into the next epoch between them (see ``Worker.epoch_iterator``).

Invariants:

* Everything DALI happens on the process's main thread: one EvalContext for the worker's whole
  life (rule 8), at most one capture loop at a time, always on that thread (rule 10).
* The control channel is read and written by the main thread only.
* The worker owns its control state (``Worker.control``: ``on_error`` and the samples known to
  fail, for the process's life; ``Sources.feed``: the batches in flight, per built source) and
  hands it to a sharded source (:mod:`workers._control`); only the main thread writes it.
* DALI's random generators are set only right after the sources are built, before any loop over
  them (``Worker.random``, :mod:`workers._random`); every batch carries their states after its
  step.
* A slot is written only between acquiring it and publishing it; the worker never touches a
  published slot until the trainer's ``Release`` for that exact generation arrives.
* Every exception becomes one ``WorkerFailure`` record, in order after the batches already sent;
  the worker then stops. A dead trainer (closed channel) ends the worker silently.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
import time
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ipc import ChannelClosed, ControlChannel, wire
from ipc.wire import Position

from . import _dali, _error_text, _stderr
from ._control import SampleControl
from ._phase import Phase
from ._publish import Publisher, describe_outputs, normalize_outputs
from ._random import RandomGenerators
from ._sources import Sources, build_sources, delivery_info
from ._spec import WorkerSpec
from ._timing import BatchClock

logger = logging.getLogger("workers")


class AbortRequested(Exception):
    """The trainer asked to stop the current epoch."""


class ShutdownRequested(Exception):
    """The trainer asked the worker to exit."""


class Stop(Exception):
    """A failure was reported; the worker must exit."""


@dataclass
class _Signature:
    """What an epoch's signature needs, gathered at its first step: whether one is due, when
    the epoch started, the outputs' schema and the batch size."""

    due: bool
    started: float
    schema: tuple[tuple[wire.OutputSchema, ...], str] | None = None
    batch_size: int = 0

    def seconds(self) -> float:
        return time.perf_counter() - self.started


class Worker:
    """The state of one worker process; see the module docstring for its invariants."""

    def __init__(self, spec: WorkerSpec, channel: ControlChannel) -> None:
        self.spec = spec
        self.channel = channel
        self.shard = spec.shard
        self.ctx: Any = None
        self.sources: Sources | None = None
        self.publisher: Publisher | None = None
        self.epoch: int | None = None
        self.step: int | None = None
        self.phase = Phase.STARTUP
        self.traces = 0
        self.rebuilds = 0
        self.last_epoch_done: int | None = None
        #: a capture loop kept from one epoch to the next (``continuous`` sharded sources):
        #: the iterator, and the epoch its next batch belongs to
        self.stream: Iterator[Any] | None = None
        self.stream_epoch: int | None = None
        #: on_error and the samples known to fail (replaced without loading), for every source
        self.control = SampleControl(spec.on_error, spec.bad_samples, self.report_skipped)
        #: DALI's random generators: their states after each step, restored at a resume
        self.random = RandomGenerators()
        #: the stage times of each batch (sent with it)
        self.clock = BatchClock()

    def set_phase(self, phase: Phase) -> None:
        self.phase = phase

    # ----------------------------------------------------------------------- start
    def start(self) -> None:
        """Make the EvalContext and the publisher, build the sources, say Hello."""
        self.ctx = _dali.make_context(self.spec.num_threads, self.spec.device_id)
        self.publisher = Publisher(self.spec, self.channel, self.ctx, self.wait_for_trainer)
        # epoch 0 from its start, or (a replacement) where its predecessor stopped, its random
        # generators as they were at that batch
        self.sources = build_sources(self.spec, self.shard, self.set_phase, self.control)
        self.clock.follow(self.sources.sampled)
        self.random.rebuilt(self.spec.random)
        self.phase = Phase.IDLE
        self.channel.send(
            wire.Hello(
                os.getpid(),
                self.spec.num_threads,
                self.spec.device_id,
                self.sources.steps_per_epoch,
                self.sources.sampling(),
                self.sources.first_epoch_steps,
                () if self.sources.sampled is None else self.sources.sampled.left_out,
            )
        )

    def rebuild_sources(
        self,
        epoch: int,
        reason: str,
        position: Position | None = None,
        random: wire.RandomStates = b"",
    ) -> None:
        """Sources for ``epoch`` (from ``position``), the random generators seeded for it or,
        when given, in the states ``random`` (no capture loop is live here: DALI allows it)."""
        disabled = self.sources is not None and _dali.is_disabled(self.sources.source)
        self.drop_stream()
        self.sources = None
        gc.collect()  # lets DALI shut the torn-down pipeline's threads down now
        shard = self.shard.for_epoch(epoch, position)
        self.sources = build_sources(self.spec, shard, self.set_phase, self.control)
        self.clock.follow(self.sources.sampled)
        self.random.rebuilt(random)
        self.phase = Phase.IDLE
        self.rebuilds += 1
        self.last_epoch_done = None  # the next epoch sends a signature again, even when eager
        logger.info(
            "worker %d (%s) rebuilt its source for epoch %d: %s%s",
            self.shard.worker,
            self.shard.describe(),
            epoch,
            reason,
            " (DALI had disabled the reader)" if disabled else "",
        )

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
        self.rebuild_sources(position.epoch, reason, position, message.random)
        assert self.sources is not None
        steps = self.sources.first_epoch_steps
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

    def serve(self) -> None:
        """Answer commands until Shutdown, a failure, or the trainer going away."""
        clock = self.clock
        while True:
            waited = time.perf_counter_ns()
            message = self.channel.recv()
            clock.idle(time.perf_counter_ns() - waited)
            try:
                self.handle(message, in_epoch=False)
            except ShutdownRequested:
                return

    # ----------------------------------------------------------------------- epochs
    def run_epoch(self, epoch: int) -> None:
        spec, sources = self.spec, self.sources
        assert sources is not None and self.publisher is not None
        self.epoch, self.step = epoch, 0
        self.phase = Phase.DALI
        tracing = _dali.will_trace(sources.source, spec.capture)
        signature = _Signature(tracing or self.last_epoch_done is None, time.perf_counter())
        iterator: Iterator[Any] | None = None
        try:
            steps = self.epoch_steps(epoch, tracing)  # None: ends when the source does
            iterator = self.epoch_iterator(epoch, steps is not None)
            self.run_steps(epoch, steps, iterator, tracing, signature)
            if signature.due and signature.schema is not None:
                self.send_signature(signature.schema, signature.batch_size, signature.seconds())
        except AbortRequested:
            self.close_epoch_iterator(iterator)
            self.abort_idle(epoch)
            self.epoch = self.step = None
            self.phase = Phase.IDLE
            return
        except (ShutdownRequested, ChannelClosed, Stop):
            self.close_epoch_iterator(iterator)
            raise
        except Exception as error:
            self.report(error)
            self.close_epoch_iterator(iterator)
            raise Stop from error
        self.last_epoch_done = epoch
        self.channel.send(wire.EpochEnd(epoch, self.step, self.traces, self.rebuilds))
        self.epoch = self.step = None
        self.phase = Phase.IDLE

    def run_steps(
        self,
        epoch: int,
        steps: int | None,
        iterator: Iterator[Any],
        tracing: bool,
        signature: _Signature,
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
                if not self.can_isolate(error):
                    raise
                self.close_epoch_iterator(iterator)
                self.skip_failing_samples(error, epoch, step)  # raises
            step += 1
            self.step = step
            self.drain()
            step_started = clock.begin()

    def run_step(
        self,
        epoch: int,
        step: int,
        steps: int | None,
        iterator: Iterator[Any],
        tracing: bool,
        signature: _Signature,
        step_started: int,
    ) -> bool:
        """One step: the source's next inputs, ``step``, the batch published. False when the
        source ended (an epoch that ends with its source)."""
        sources, publisher = self.sources, self.publisher
        assert sources is not None and publisher is not None
        self.phase = Phase.DALI
        try:
            inputs = next(iterator)
        except StopIteration:
            if steps is not None:  # a continuous source never ends
                raise wire.ProtocolError(
                    f"the source ended after {step} of {steps} batches"
                ) from None
            return False
        if tracing and step == 0:  # an epoch without batches traces nothing
            self.traces += 1
        if signature.due and step == 1:  # after the traced step
            assert signature.schema is not None
            self.send_signature(signature.schema, signature.batch_size, signature.seconds())
            signature.due = False
        self.phase = Phase.STEP
        outputs = self.call_step(inputs, sources.feeders)
        random = self.random.after_step()  # (DALI draws when an operator is called)
        self.phase = Phase.TRANSPORT
        named, kind = normalize_outputs(outputs)
        if signature.schema is None:
            signature.schema = (describe_outputs(named), kind)
            signature.batch_size = next(iter(named.values())).batch_size
        padded, replaced, skipped, names = delivery_info(sources, step, signature.batch_size)
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
        )
        return True

    def epoch_steps(self, epoch: int, tracing: bool) -> int | None:
        """Batches of ``epoch`` when one capture loop runs on from it into the next epochs (see
        ``epoch_iterator``); None when this epoch's loop ends with the source."""
        sources = self.sources
        sampled = None if sources is None else sources.sampled
        # a sharded root, captured, without feeders (they end with each epoch's loop)
        if sources is None or sampled is None or not self.spec.capture or sources.feeders:
            return None
        steps = sampled.epoch_steps(epoch)
        if self.stream is None and tracing and steps < 2:
            # DALI ends the traced step at the loop's next call; made in the next epoch's
            # frame, that call finds nothing captured. This epoch gets a loop of its own.
            return None
        return steps

    def epoch_iterator(self, epoch: int, continuous: bool) -> Iterator[Any]:
        """The capture loop of ``epoch``. A continuous source keeps one loop for every epoch:
        ended by step count, not by the source, the loop stays suspended between epochs and
        DALI's prefetch has already started on the next epoch's first batch (as it does for a
        reader) when the trainer starts that epoch."""
        sources, spec = self.sources, self.spec
        assert sources is not None
        if not continuous:
            sources.feed.continuous = False
            return _dali.epoch_iterator(sources.source, spec.batch_size, self.ctx, spec.capture)
        if self.stream is None:
            assert sources.sampled is not None
            sources.feed.continuous = True
            self.stream = _dali.epoch_iterator(
                sources.source, spec.batch_size, self.ctx, spec.capture
            )
            self.stream_epoch = epoch
        elif self.stream_epoch != epoch:
            raise wire.ProtocolError(
                f"StartEpoch({epoch}), but the source's next batches are of epoch "
                f"{self.stream_epoch}"
            )
        self.stream_epoch = epoch + 1
        return self.stream

    def close_epoch_iterator(self, iterator: Iterator[Any] | None) -> None:
        if iterator is self.stream:
            self.drop_stream()
        else:
            close_iterator(iterator)

    def drop_stream(self) -> None:
        """End the capture loop kept between epochs (before the sources are rebuilt)."""
        stream, self.stream, self.stream_epoch = self.stream, None, None
        close_iterator(stream)

    # ----------------------------------------------------------------------- bad samples
    def can_isolate(self, error: BaseException) -> bool:
        """Whether a failed batch can be searched for the sample that broke it: a batch of a
        ``sharded_source``/``sharded_files`` root that failed inside DALI or ``step`` (a
        failing ``load`` is already handled sample by sample), with no feeders."""
        sources = self.sources
        return (
            sources is not None
            and sources.sampled is not None
            and not sources.feeders
            and self.phase in (Phase.DALI, Phase.STEP, Phase.TRANSPORT)
            and getattr(error, "_loader_phase", None) is None
        )

    def find_failing_samples(self, epoch: int, step: int) -> dict[int, list[str]] | None:
        """The samples of the batch at ``step`` of ``epoch`` (or, when DALI's prefetch
        reported it early, of the next one) that fail on their own, each with the native log
        lines it printed then (see :mod:`workers._stderr`). None when every sample of a batch
        of several fails alone: then ``step`` or the pipeline is at fault, not the data.

        Method: each sample of the batch is loaded and run through ``step`` alone, eagerly (a
        batch of one, in the worker's EvalContext): it costs one re-run of the batch's samples.
        What native code logs during the re-run repeats what the failed batch already printed:
        it is kept for the error, not printed again.
        """
        sources = self.sources
        assert sources is not None and sources.sampled is not None
        sampled = sources.sampled
        for candidate in (step, step + 1):
            found = sampled.batch_at(epoch, candidate)
            if found is None:
                continue
            batch, replaced = found
            ids = [index for index in dict.fromkeys(batch) if index not in replaced]
            failing: dict[int, list[str]] = {}
            for index in ids:
                with _stderr.repeats_captured() as printed:
                    fails = self.sample_fails(sampled, index, epoch)
                if fails:
                    failing[index] = printed.native
                if printed.native:
                    logger.debug(
                        "worker %d: %s printed when run alone: %s",
                        self.shard.worker,
                        sampled.describe(index),
                        "; ".join(printed.native),
                    )
            if failing:
                return failing if len(failing) < len(ids) or len(ids) == 1 else None
        return {}

    def sample_fails(self, sampled: Any, index: int, epoch: int) -> bool:
        import numpy as np
        import nvidia.dali.experimental.dynamic as ndd

        try:
            sample = sampled.load_sample(index, epoch)
            if sampled.num_outputs == 1:
                inputs: Any = ndd.batch([np.asarray(sample)])
            else:
                inputs = tuple(ndd.batch([np.asarray(part)]) for part in sample)
            with self.ctx:
                named, _kind = normalize_outputs(self.call_step(inputs, {}))
                for batch in named.values():
                    _dali.storage_of(batch)  # evaluate: DALI's errors surface here
        except Exception:
            return True
        return False

    def skip_failing_samples(self, error: BaseException, epoch: int, done: int) -> None:
        """After a batch failed: find its failing samples. With ``on_error="skip"`` tell the
        trainer which they are and end this process: the trainer starts a new one at that
        batch with them replaced. (A process whose captured pipeline failed must not trace
        again: DALI 2.4 then crashes with captured random operators.) Otherwise, or when no
        sample fails alone, raise ``error``, its message naming them first (DALI names only
        the operator)."""
        sources = self.sources
        assert sources is not None and sources.sampled is not None
        sampled = sources.sampled
        failing = self.find_failing_samples(epoch, done)
        if failing is None:
            error._loader_message = _error_text.every_sample_fails(error)  # type: ignore[attr-defined]
            raise error
        printed = list(dict.fromkeys(line for lines in failing.values() for line in lines))
        if self.spec.on_error != "skip" or not failing:
            if failing:
                names = [sampled.describe(index) for index in failing]
                error._loader_message = _error_text.message(error, names, printed)  # type: ignore[attr-defined]
            raise error
        self.channel.send(
            wire.SamplesFailed(
                epoch=epoch,
                step=done,
                ids=tuple(failing),
                names=tuple(sampled.name(index) for index in failing),
                reason=_error_text.short_reason(error, printed),
            )
        )
        raise Stop

    def report_skipped(self, epoch: int, step: int, index: int, name: str, reason: str) -> None:
        """on_error="skip": sample ``index``'s ``load`` raised, so batch ``step`` of ``epoch``
        was made without it. The trainer logs it (once, whichever worker reports it first) and
        tells the other workers, which then replace it without loading it; this one goes on."""
        with contextlib.suppress(ChannelClosed, OSError):
            self.channel.send(
                wire.SamplesFailed(epoch, step, (index,), (name,), reason, exits=False)
            )

    def load_in_progress(self) -> wire.LoadRunning | None:
        """The sample whose ``load`` runs now (on the prefetch thread), and for how long; for
        the trainer, which asks for the stack of a worker that sent nothing for too long."""
        sampled = None if self.sources is None else self.sources.sampled
        loading = None if sampled is None else sampled.loading
        if sampled is None or loading is None:
            return None
        index, started = loading
        try:
            name = sampled.name(index)
        except Exception:
            name = str(index)
        epoch, step = sampled.loading_batch
        return wire.LoadRunning(index, time.monotonic() - started, name, epoch, step)

    def call_step(self, inputs: Any, feeders: dict[str, Any]) -> Any:
        if isinstance(inputs, Mapping):
            return self.spec.step(**inputs, **feeders)
        if isinstance(inputs, tuple):
            return self.spec.step(*inputs, **feeders)
        return self.spec.step(inputs, **feeders)

    def send_signature(
        self,
        schema: tuple[tuple[wire.OutputSchema, ...], str],
        batch_size: int,
        trace_seconds: float,
    ) -> None:
        assert self.sources is not None
        state = _dali.capture_state(self.sources.source, self.spec.capture)
        outputs, kind = schema
        self.channel.send(
            wire.Signature(
                batch_size=batch_size,
                device=self.spec.device,
                device_id=self.spec.device_id,
                num_threads=self.spec.num_threads,
                outputs=outputs,
                output_kind=kind,
                captured=state == "captured",
                capture_requested=self.spec.capture,
                dali_version=_dali.DALI_VERSION,
                trace_seconds=trace_seconds,
            )
        )

    # ----------------------------------------------------------------------- errors
    def report(self, error: BaseException) -> None:
        kind = type(error)
        phase = getattr(error, "_loader_phase", None) or self.phase.value
        # DALI's long text in a line, the failing samples first when they are known; the
        # whole text travels in the traceback
        message = getattr(error, "_loader_message", None) or _error_text.message(error)
        with contextlib.suppress(ChannelClosed, OSError):
            self.channel.send(
                wire.WorkerFailure(
                    type_module=kind.__module__,
                    type_name=kind.__qualname__,
                    message=message,
                    traceback="".join(traceback.format_exception(error)),
                    epoch=self.epoch,
                    step=self.step,
                    phase=phase,
                )
            )

    def relay_warning(
        self,
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: Any = None,
        line: str | None = None,
    ) -> None:
        if threading.get_ident() != threading.main_thread().ident:
            return
        with contextlib.suppress(ChannelClosed, OSError):
            self.channel.send(
                wire.WarningRelay(
                    category.__module__, category.__qualname__, str(message), filename, lineno
                )
            )

    def close(self) -> None:
        self.drop_stream()
        self.sources = None
        self.random.close()
        if self.publisher is not None:
            self.publisher.close()
        self.channel.close()


def close_iterator(iterator: Iterator[Any] | None) -> None:
    close = getattr(iterator, "close", None)
    if close is not None:
        with contextlib.suppress(Exception):
            close()
