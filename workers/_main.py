"""The worker process: owns one shard's DALI source and runs one capture loop per epoch.

Runs only in a spawned worker process. ``run_worker`` is the process entry point.

Invariants:

* Everything DALI happens on the process's main thread: one EvalContext for the worker's whole
  life (rule 8), at most one capture loop at a time, always on that thread (rule 10).
* The control channel is read and written by the main thread only. A second thread only watches
  the trainer's liveness pipe and exits the process when the trainer is gone.
* A slot is written only between ``SlotRing.acquire`` and ``publish``; the worker never touches
  a published slot until the trainer's ``Release`` for that exact generation arrives.
* Every exception becomes one ``WorkerFailure`` record, in order after the batches already sent;
  the worker then stops. A dead trainer (closed channel) ends the worker silently.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import gc
import logging
import os
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Iterator, Mapping
from multiprocessing.connection import Connection
from typing import Any

import psutil

from ipc import (
    Arena,
    ChannelClosed,
    ControlChannel,
    SharedMemoryError,
    SlotRing,
    place_outputs,
    round_up,
)
from ipc import _wire as wire

from . import _dali, _sampling
from ._spec import WorkerSpec

logger = logging.getLogger("workers")

#: A first slot is this much larger than the first batch, so small size changes need no growth.
SLOT_HEADROOM = 1.25
_PR_SET_PDEATHSIG = 1


class _AbortRequested(Exception):
    """The trainer asked to stop the current epoch."""


class _ShutdownRequested(Exception):
    """The trainer asked the worker to exit."""


class _Stop(Exception):
    """A failure was reported; the worker must exit."""


class _RelayHandler(logging.Handler):
    """Forwards this process's log records to the trainer (main thread only)."""

    def __init__(self, channel: ControlChannel) -> None:
        super().__init__()
        self._channel = channel
        self._owner = threading.get_ident()

    def emit(self, record: logging.LogRecord) -> None:
        if threading.get_ident() != self._owner:
            return
        with contextlib.suppress(ChannelClosed, OSError):
            self._channel.send(wire.LogRelay(record.levelno, record.getMessage()))


class Worker:
    """The state of one worker process; see the module docstring for its invariants."""

    def __init__(self, spec: WorkerSpec, channel: ControlChannel) -> None:
        self.spec = spec
        self.channel = channel
        self.shard = spec.shard
        self.ring = SlotRing(spec.num_slots)
        self.arena: Arena | None = None
        self.arena_id = 0
        self.ctx: Any = None
        self.source: Any = None
        self.feeders: dict[str, Any] = {}
        self.epoch: int | None = None
        self.step: int | None = None
        self.phase = "startup"
        self.traces = 0
        self.rebuilds = 0
        self.last_epoch_done: int | None = None
        self._blocked_ns = 0
        self.steps_per_epoch: int | None = None
        self.reader_shard_size: int | None = None
        self.cuda: Any = None  # ipc CudaExporter, once a GPU batch was published
        self._retired_cuda: list[Any] = []

    # ----------------------------------------------------------------------- sources
    def build_sources(self, epoch: int) -> None:
        shard = self.shard.for_epoch(epoch)
        _dali.seed_random(shard.seed + epoch * shard.count)
        self.phase = "source"
        source = self.spec.source(shard)
        problem = _dali.describe_source_error(source)
        if problem is not None:
            raise TypeError(problem)
        shard_size = _dali.probe_reader(source, self.spec.batch_size)
        self.steps_per_epoch = None
        sampled = _sampling.padding_of(source)
        if sampled is not None:
            self.steps_per_epoch = len(sampled)
        elif shard_size is not None and _dali.sticks_to_shard(source):
            self.steps_per_epoch = -(-shard_size // self.spec.batch_size)
        # A reader that sticks to its shard and pads its last batch repeats the shard's last
        # sample: those rows are flagged as padding like sharded_source's.
        self.reader_shard_size = (
            shard_size
            if shard_size is not None
            and _dali.sticks_to_shard(source)
            and _dali.pads_last_batch(source)
            else None
        )
        if shard_size == 0:
            raise ValueError(
                f"{shard.describe()} has no samples: the dataset has fewer samples than "
                f"shards ({shard.count}); use fewer workers or ranks, or more data"
            )
        feeders: dict[str, Any] = {}
        if self.spec.feeders is not None:
            self.phase = "feeders"
            made = self.spec.feeders(shard)
            if not isinstance(made, Mapping):
                raise TypeError(
                    f"feeders(shard) must return a dict of name -> ndd.ExternalSource, "
                    f"got {type(made).__name__}"
                )
            for name, feeder in made.items():
                if not _dali.is_external_source(feeder):
                    raise TypeError(
                        f"feeder {name!r} must be an ndd.ExternalSource, "
                        f"got {type(feeder).__name__}"
                    )
            feeders = dict(made)
        self.source, self.feeders = source, feeders
        self.phase = "idle"

    def rebuild_sources(self, epoch: int, reason: str) -> None:
        disabled = _dali.is_disabled(self.source)
        self.source = None
        self.feeders = {}
        gc.collect()  # lets DALI shut the torn-down pipeline's threads down now
        self.build_sources(epoch)
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
        if isinstance(message, wire.Release):
            for slot, generation in message.fills:
                self.ring.release(slot, generation)
        elif isinstance(message, wire.AbortEpoch):
            if in_epoch:
                raise _AbortRequested
            self.abort_idle(message.epoch)
        elif isinstance(message, wire.CudaFreeEvents):
            exporter = self.cuda
            if exporter is not None and exporter.arena_id == message.arena_id:
                exporter.set_free_events(message.handles)
        elif isinstance(message, wire.Shutdown):
            raise _ShutdownRequested
        elif isinstance(message, wire.StartEpoch):
            if in_epoch:
                raise RuntimeError("protocol error: StartEpoch during an epoch")
            self.run_epoch(message.epoch)
        else:
            raise RuntimeError(f"protocol error: unexpected {type(message).__name__}")

    def abort_idle(self, epoch: int) -> None:
        self.rebuild_sources(epoch + 1, f"the trainer left epoch {epoch} early")
        self.channel.send(wire.EpochAborted(epoch, rebuilt=True))

    def drain(self) -> None:
        while self.channel.ready():
            self.handle(self.channel.recv(), in_epoch=True)

    def acquire_slot(self) -> int:
        slot = self.ring.acquire()
        if slot is not None:
            return slot
        started = time.perf_counter_ns()
        while slot is None:
            self.handle(self.channel.recv(), in_epoch=True)
            slot = self.ring.acquire()
        self._blocked_ns += time.perf_counter_ns() - started
        return slot

    # ----------------------------------------------------------------------- epochs
    def serve(self) -> None:
        """Answer commands until Shutdown, a failure, or the trainer going away."""
        while True:
            try:
                self.handle(self.channel.recv(), in_epoch=False)
            except _ShutdownRequested:
                return

    def run_epoch(self, epoch: int) -> None:
        spec = self.spec
        self.epoch, self.step = epoch, 0
        self.phase = "dali"
        tracing = _dali.will_trace(self.source, spec.capture)
        signature_due = tracing or self.last_epoch_done is None
        if tracing:
            self.traces += 1
        started = time.perf_counter()
        trace_seconds = 0.0
        schema: tuple[tuple[wire.OutputSchema, ...], str] | None = None
        batch_size = 0
        iterator: Iterator[Any] | None = None
        sampled = _sampling.padding_of(self.source)
        try:
            iterator = _dali.epoch_iterator(self.source, spec.batch_size, self.ctx, spec.capture)
            step_started = time.perf_counter_ns()
            while True:
                self.phase = "dali"
                try:
                    inputs = next(iterator)
                except StopIteration:
                    break
                if signature_due and self.step == 1:
                    assert schema is not None
                    trace_seconds = time.perf_counter() - started
                    self.send_signature(schema, batch_size, trace_seconds)
                    signature_due = False
                self.phase = "step"
                outputs = self.call_step(inputs)
                self.phase = "transport"
                named, kind = normalize_outputs(outputs)
                if schema is None:
                    schema = (describe_outputs(named), kind)
                    batch_size = next(iter(named.values())).batch_size
                padded = self.padded_rows(sampled, batch_size)
                self.publish(epoch, self.step, named, step_started, padded)
                self.step += 1
                self.drain()
                step_started = time.perf_counter_ns()
            if signature_due and schema is not None:
                trace_seconds = time.perf_counter() - started
                self.send_signature(schema, batch_size, trace_seconds)
        except _AbortRequested:
            self.close_iterator(iterator)
            self.abort_idle(epoch)
            self.epoch = self.step = None
            self.phase = "idle"
            return
        except (_ShutdownRequested, ChannelClosed):
            self.close_iterator(iterator)
            raise
        except Exception as error:
            self.report(error)
            self.close_iterator(iterator)
            raise _Stop from error
        self.last_epoch_done = epoch
        self.channel.send(wire.EpochEnd(epoch, self.step, self.traces, self.rebuilds))
        self.epoch = self.step = None
        self.phase = "idle"

    def padded_rows(self, sampled: _sampling.BatchedSamples | None, batch_size: int) -> int:
        """Rows of the current step's batch that are padding: counted by ``sharded_source``, or
        past the shard's end for a reader that sticks to its shard and pads its last batch."""
        if sampled is not None and sampled.padding:
            return sampled.padding.popleft()
        if self.reader_shard_size is not None and self.step is not None:
            rows = (self.step + 1) * batch_size
            return max(0, min(batch_size, rows - self.reader_shard_size))
        return 0

    def call_step(self, inputs: Any) -> Any:
        if isinstance(inputs, Mapping):
            return self.spec.step(**inputs, **self.feeders)
        if isinstance(inputs, tuple):
            return self.spec.step(*inputs, **self.feeders)
        return self.spec.step(inputs, **self.feeders)

    @staticmethod
    def close_iterator(iterator: Iterator[Any] | None) -> None:
        close = getattr(iterator, "close", None)
        if close is not None:
            with contextlib.suppress(Exception):
                close()

    def send_signature(
        self,
        schema: tuple[tuple[wire.OutputSchema, ...], str],
        batch_size: int,
        trace_seconds: float,
    ) -> None:
        state = _dali.capture_state(self.source, self.spec.capture)
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

    # ----------------------------------------------------------------------- transport
    def ensure_arena(self, nbytes: int) -> Arena:
        arena = self.arena
        if arena is not None and nbytes <= arena.slot_size:
            return arena
        grow = arena is not None
        num_slots = self.spec.num_slots
        needed = round_up(max(nbytes, 1), 4096)
        slot_size = round_up(max(int(nbytes * SLOT_HEADROOM), 1), 4096)
        if arena is not None:
            slot_size = max(slot_size, 2 * arena.slot_size)
        limit = self.spec.shm_limit
        if limit is not None and slot_size * num_slots > limit:
            slot_size = max(needed, (limit // num_slots) // 4096 * 4096)
        total = slot_size * num_slots
        available = psutil.virtual_memory().available
        if (limit is not None and total > limit) or total > available:
            why = (
                f"shm_limit is {limit} bytes"
                if limit is not None and total > limit
                else f"only {available} bytes of memory are available"
            )
            raise SharedMemoryError(
                f"worker {self.shard.worker} needs {needed * num_slots} bytes "
                f"({needed * num_slots / 2**20:.1f} MiB: {num_slots} slots of {needed} bytes "
                f"for batches of {nbytes} bytes) of shared memory, but {why}. Raise shm_limit, "
                "lower prefetch or the batch size, or free memory"
            )
        self.arena_id += 1
        new = Arena.create(
            self.arena_id,
            slot_size,
            self.spec.num_slots,
            label=f"dali-capture-loader-w{self.shard.worker}",
        )
        try:
            self.channel.send(
                wire.ArenaReady(self.arena_id, new.slot_size, new.num_slots, backend="cpu")
            )
            self.channel.send_fd(new.fd)
        finally:
            new.close_fd()
        if arena is not None:
            arena.close()
        self.arena = new
        if grow:
            logger.debug("worker %d grew its slots to %d bytes", self.shard.worker, new.slot_size)
        return new

    def ensure_cuda(self, nbytes: int) -> Any:
        """The worker's CUDA slot ring, (re)made large enough for ``nbytes``."""
        from ipc._cuda import CudaExporter

        exporter = self.cuda
        if exporter is not None and nbytes <= exporter.slot_size:
            return exporter
        assert self.spec.device_id is not None
        self.arena_id += 1
        new = CudaExporter(
            self.arena_id, self.spec.device_id, int(nbytes * SLOT_HEADROOM), self.spec.num_slots
        )
        stream = _dali.context_stream(self.ctx)
        if stream is not None:
            # copy on DALI's own stream of this worker: ordered after the batch was produced
            new.stream = _StreamHandle(stream)
        self.channel.send(
            wire.CudaRingReady(
                new.arena_id, new.device_id, new.slot_size, new.memory_handles, new.ready_handles
            )
        )
        if exporter is not None:
            self._retired_cuda.append(exporter)  # slots may still be in the trainer's hands
        self.cuda = new
        return new

    def publish(
        self, epoch: int, step: int, named: dict[str, Any], started_ns: int, padded: int = 0
    ) -> None:
        """Copy one batch into a free slot (shared memory, or the CUDA ring with device='gpu'),
        one packed copy per output, then send its descriptor."""
        gpu = self.spec.device == "gpu"
        device = "gpu" if gpu else "cpu"
        storages = []
        described = []
        for name, batch in named.items():
            if _dali.batch_device(batch) != device:
                batch = batch.gpu() if gpu else batch.cpu()
            storage = _dali.storage_of(batch)
            dtype = _dali.numpy_dtype(storage, name)
            storages.append(storage)
            shapes = _dali.sample_shapes(storage)
            described.append((name, dtype.str, dtype.itemsize, shapes, _dali.layout_of(storage)))
        placements, nbytes = place_outputs(described)
        blocked_before = self._blocked_ns
        slot = self.acquire_slot()
        try:
            if gpu:
                exporter = self.ensure_cuda(nbytes)
                arena_id, base = exporter.arena_id, exporter.begin_write(slot)
                for storage, placement in zip(storages, placements, strict=True):
                    if placement.nbytes:
                        address = base + placement.offset
                        _dali.copy_packed_gpu(storage, address, exporter.stream.ptr)
                exporter.finish_write(slot)
            else:
                arena = self.ensure_arena(nbytes)
                arena_id, base = arena.arena_id, arena.slot_address(slot)
                for storage, placement in zip(storages, placements, strict=True):
                    if placement.nbytes:
                        _dali.copy_packed(storage, base + placement.offset)
        except BaseException:
            self.ring.abandon(slot)
            raise
        generation = self.ring.publish(slot)
        blocked = self._blocked_ns - blocked_before
        self.channel.send(
            wire.BatchReady(
                epoch=epoch,
                step=step,
                arena_id=arena_id,
                slot=slot,
                generation=generation,
                outputs=placements,
                nbytes=nbytes,
                padded=padded,
                blocked_ns=blocked,
                busy_ns=time.perf_counter_ns() - started_ns - blocked,
            )
        )

    # ----------------------------------------------------------------------- errors
    def report(self, error: BaseException) -> None:
        kind = type(error)
        with contextlib.suppress(ChannelClosed, OSError):
            self.channel.send(
                wire.WorkerFailure(
                    type_module=kind.__module__,
                    type_name=kind.__qualname__,
                    message=str(error),
                    traceback="".join(traceback.format_exception(error)),
                    epoch=self.epoch,
                    step=self.step,
                    phase=self.phase,
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
        self.source = None
        self.feeders = {}
        for exporter in [*self._retired_cuda, self.cuda]:
            if exporter is not None:
                exporter.close()
        self.cuda = None
        self._retired_cuda = []
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        self.channel.close()


class _StreamHandle:
    """A raw CUDA stream handle with the ``.ptr`` attribute cupy's API expects."""

    def __init__(self, pointer: int) -> None:
        self.ptr = pointer

    def synchronize(self) -> None:
        import cupy

        cupy.cuda.runtime.streamSynchronize(self.ptr)


def normalize_outputs(outputs: Any) -> tuple[dict[str, Any], str]:
    """``step``'s result as ``{name: Batch}`` plus its kind: ``dict``, ``tuple`` or ``single``."""
    if isinstance(outputs, Mapping):
        named, kind = {str(k): v for k, v in outputs.items()}, "dict"
    elif isinstance(outputs, (tuple, list)):
        named, kind = {str(i): v for i, v in enumerate(outputs)}, "tuple"
    else:
        named, kind = {"0": outputs}, "single"
    if not named:
        raise ValueError("step() returned no outputs; return a dict or tuple of DALI batches")
    sizes = set()
    for name, value in named.items():
        if not _dali.is_batch(value):
            raise TypeError(
                f"step() output {name!r} is a {type(value).__name__}, not a DALI Batch; "
                "return the batches produced by DALI operators (not samples or numpy arrays)"
            )
        sizes.add(value.batch_size)
    if len(sizes) != 1:
        raise ValueError(f"step() outputs have different batch sizes: {sorted(sizes)}")
    return named, kind


def describe_outputs(named: Mapping[str, Any]) -> tuple[wire.OutputSchema, ...]:
    schema = []
    for name, batch in named.items():
        schema.append(
            wire.OutputSchema(
                name=name,
                dtype=str(batch.dtype),
                ndim=int(batch.ndim),
                layout=str(batch.layout or ""),
            )
        )
    return tuple(schema)


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


def run_worker(spec: WorkerSpec, conn: Connection, stack: Connection, alive: Connection) -> None:
    """Process entry point. Never returns normally: the process exits when serving ends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    faulthandler.enable(file=stack.fileno(), all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=stack.fileno(), all_threads=True, chain=False)
    if spec.parent_death_signal:
        _set_parent_death_signal(spec.parent_pid)
    threading.Thread(
        target=_watch_trainer, args=(alive,), daemon=True, name="trainer-watch"
    ).start()

    channel = ControlChannel(conn)
    worker = Worker(spec, channel)
    logging.getLogger().handlers[:] = [_RelayHandler(channel)]
    logging.getLogger().setLevel(spec.log_level)
    warnings.showwarning = worker.relay_warning
    code = 0
    try:
        worker.ctx = _dali.make_context(spec.num_threads, spec.device_id)
        worker.build_sources(0)
        channel.send(
            wire.Hello(os.getpid(), spec.num_threads, spec.device_id, worker.steps_per_epoch)
        )
        worker.serve()
    except (_Stop, _ShutdownRequested, ChannelClosed):
        pass
    except Exception as error:
        worker.report(error)
        code = 1
    finally:
        with contextlib.suppress(Exception):
            worker.close()
        sys.stdout.flush()
        sys.stderr.flush()
    # Skip interpreter teardown: DALI's thread pools need not be joined in a process that ends.
    os._exit(code)
