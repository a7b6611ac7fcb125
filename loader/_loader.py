"""``Loader``: the user's iterable over batches made by worker processes. Runs in the trainer.

Order: within an epoch, batches come round-robin over workers (worker 0's first batch, worker 1's
first, ..., worker 0's second, ...), skipping workers whose shard has ended. The trainer always
waits for the specific worker whose turn it is, so the sequence depends only on the seed.

Epochs: ``iter(loader)`` starts the next epoch in every worker. Leaving an epoch early and calling
``iter`` again aborts it everywhere first: every worker stops its loop, rebuilds its source and
feeders for the next epoch (so DALI re-traces), and acknowledges; only then does the next epoch
start, complete and from the start of every shard.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ipc import _wire as wire
from workers import Shard, WorkerSpec

from . import _distributed, _env
from ._coordinator import Coordinator
from ._errors import LoaderClosedError
from ._pool import WorkerPool
from ._validate import check_choice, check_importable, check_positive_int
from ._views import BatchInfo, build_batch, build_cuda_batch, current_stream

logger = logging.getLogger("loader")

OUTPUTS = ("numpy", "torch", "cupy")
DEVICES = ("cpu", "gpu")


@dataclass(frozen=True)
class WorkerStats:
    worker: int
    shard: int
    pid: int | None
    steps: int
    traces: int
    rebuilds: int
    trace_seconds: tuple[float, ...]
    busy_seconds: float
    blocked_seconds: float
    batches_per_second: float
    bytes: int


@dataclass(frozen=True)
class LoaderStats:
    workers: tuple[WorkerStats, ...]
    batches: int
    bytes_moved: int
    wait_seconds: float
    slots_in_use: int
    elapsed_seconds: float
    time_to_first_batch: float | None

    @property
    def samples_per_second(self) -> float:
        return 0.0 if self.elapsed_seconds <= 0 else self.batches / self.elapsed_seconds


class Loader:
    """Batches from ``num_workers`` worker processes, each running DALI capture over one shard.

    ``source(shard)`` (runs in the worker, once) returns a DALI reader or ``ndd.ExternalSource``
    for that shard; ``step(*source_outputs, **feeders)`` is the loop body, traced by DALI on the
    first step and replayed after; it returns a dict, a tuple or one DALI batch. Both must be
    module-level functions: workers are spawned and import them by name.
    """

    def __init__(
        self,
        source: Callable[[Shard], Any],
        step: Callable[..., Any],
        *,
        batch_size: int,
        num_workers: int = 2,
        feeders: Callable[[Shard], Mapping[str, Any]] | None = None,
        device: str = "cpu",
        device_id: int | None = None,
        num_threads: int | None = None,
        prefetch: int = 2,
        output: str = "numpy",
        copy: bool = False,
        capture: bool = True,
        seed: int = 0,
        timeout: float | None = None,
        start_method: str = "spawn",
        rank: int | None = None,
        world_size: int | None = None,
        startup_timeout: float = 300.0,
        shm_limit: int | None = None,
    ) -> None:
        self._closed = True  # until the pool is up; close() must work on a half-built loader
        self._coordinator: Coordinator | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None
        if isinstance(batch_size, float) and not isinstance(batch_size, bool):
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if isinstance(batch_size, int) and not isinstance(batch_size, bool) and batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        self.batch_size = check_positive_int(batch_size, "batch_size")
        self.num_workers = check_positive_int(num_workers, "num_workers")
        self.prefetch = check_positive_int(prefetch, "prefetch")
        self.output = check_choice(output, "output", OUTPUTS)
        self.device = check_choice(device, "device", DEVICES)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout}")
        if num_threads is not None:
            check_positive_int(num_threads, "num_threads")
        if shm_limit is not None:
            check_positive_int(shm_limit, "shm_limit")
        check_importable(source, "source")
        check_importable(step, "step")
        if feeders is not None:
            if isinstance(feeders, Mapping):
                raise TypeError(
                    "feeders must be a module-level function feeders(shard) -> {name: "
                    "ndd.ExternalSource}, not a dict of instances: every worker loop needs its "
                    "own feeders (rule 4c), so the loader builds them in each worker"
                )
            check_importable(feeders, "feeders")
        if self.output == "torch":
            try:
                import torch  # noqa: F401
            except ImportError as error:
                raise ImportError(
                    "output='torch' needs PyTorch: pip install 'dali-capture-loader[torch]'"
                ) from error
        placement = _env.discover_placement(rank, world_size)
        if self.device == "gpu" and self.output == "numpy":
            raise ValueError(
                "device='gpu' delivers batches in GPU memory: pass output='torch' or "
                "output='cupy' (or use device='cpu' for numpy arrays)"
            )
        if self.device == "cpu" and self.output == "cupy":
            raise ValueError("output='cupy' needs device='gpu'")
        if self.output == "cupy":
            try:
                import cupy  # noqa: F401
            except ImportError as error:
                raise ImportError(
                    "output='cupy' needs CuPy: pip install 'dali-capture-loader[gpu]'"
                ) from error
        if self.device == "gpu":
            visible = _require_gpu()
            if device_id is None:
                device_id = _env.default_device_id(placement, visible)
        elif device_id is not None:
            raise ValueError("device_id= is only meaningful with device='gpu'")
        self.copy = bool(copy)
        self.capture = bool(capture)
        self.seed = seed
        self.timeout = timeout
        self._trace_timeout = None if timeout is None else max(timeout, startup_timeout)
        self.rank, self.world_size = placement.rank, placement.world_size
        self.num_threads = num_threads or _env.default_num_threads(
            self.num_workers, placement.local_world_size
        )
        self.device_id = device_id
        self.num_slots = self.prefetch + 2  # prefetch ahead, one in the user's hands, one spare
        on_main_thread = threading.current_thread() is threading.main_thread()
        specs = [
            WorkerSpec(
                source=source,
                step=step,
                feeders=feeders,
                shard=Shard.make(
                    rank=self.rank,
                    world_size=self.world_size,
                    worker=worker,
                    num_workers=self.num_workers,
                    seed=seed,
                ),
                batch_size=self.batch_size,
                capture=self.capture,
                device=self.device,
                device_id=device_id,
                num_threads=self.num_threads,
                num_slots=self.num_slots,
                parent_pid=os.getpid(),
                parent_death_signal=on_main_thread,
                log_level=logging.getLogger("loader").getEffectiveLevel(),
                shm_limit=shm_limit,
            )
            for worker in range(self.num_workers)
        ]
        self.shards = tuple(spec.shard for spec in specs)
        pool = WorkerPool(specs, start_method)
        coordinator = Coordinator(pool, timeout=timeout)
        if self.device == "gpu":
            coordinator.cuda_stream = current_stream(self.output)
        self._coordinator = coordinator
        self._finalizer = weakref.finalize(self, coordinator.close)
        self._closed = False
        self._epoch = 0
        self._current: _EpochIterator | None = None
        self._batches = 0
        self._started = time.monotonic()
        self._first_batch: float | None = None
        self._kind: str | None = None
        self._ranks_traced = False
        try:
            pool.start()
            coordinator.wait_startup(startup_timeout)
        except BaseException:
            self.close()
            raise
        self._check_ranks_at_start()
        logger.info(
            "started %d workers (rank %d/%d, %d DALI threads each, capture=%s)",
            self.num_workers,
            self.rank,
            self.world_size,
            self.num_threads,
            self.capture,
        )

    # ------------------------------------------------------------------------------ public
    @property
    def epoch(self) -> int:
        """The epoch the next ``iter(loader)`` runs."""
        return self._epoch

    def __iter__(self) -> Iterator[Any]:
        coordinator = self._require_open()
        if self._current is not None and not self._current.finished:
            self._abort(self._current)
        run = _EpochIterator(self, self._epoch)
        self._current = run
        for handle in coordinator.handles:
            handle.epoch = run.epoch
            handle.ended_epoch = None
            handle.queue.clear()
        coordinator.send_all(wire.StartEpoch(run.epoch))
        self._epoch += 1
        return run

    def __len__(self) -> int:
        """Batches this rank gets per epoch (known for readers with ``stick_to_shard=True`` and
        for :func:`sharded_source`)."""
        coordinator = self._require_open()
        steps = [h.hello.steps_per_epoch if h.hello else None for h in coordinator.handles]
        if any(s is None for s in steps):
            raise TypeError(
                "len(loader) is unknown for this source: use sharded_source() or a reader "
                "with stick_to_shard=True"
            )
        return sum(s for s in steps if s is not None)

    def close(self) -> None:
        """Stop every worker and release all shared memory. Idempotent; bounded in time."""
        self._closed = True
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed or self._coordinator is None or self._coordinator.pool.closed

    def worker_pids(self) -> list[int]:
        coordinator = self._require_open()
        return [h.pid for h in coordinator.handles if h.pid is not None]

    def stats(self) -> LoaderStats:
        """A snapshot of per-worker and trainer-side counters."""
        coordinator = self._coordinator
        assert coordinator is not None
        workers = []
        for h in coordinator.handles:
            busy = h.busy_ns / 1e9
            workers.append(
                WorkerStats(
                    worker=h.index,
                    shard=h.shard.index,
                    pid=h.pid,
                    steps=h.steps,
                    traces=h.traces,
                    rebuilds=h.rebuilds,
                    trace_seconds=tuple(h.trace_seconds),
                    busy_seconds=busy,
                    blocked_seconds=h.blocked_ns / 1e9,
                    batches_per_second=h.steps / busy if busy > 0 else 0.0,
                    bytes=h.bytes,
                )
            )
        return LoaderStats(
            workers=tuple(workers),
            batches=self._batches,
            bytes_moved=sum(w.bytes for w in workers),
            wait_seconds=coordinator.wait_ns / 1e9,
            slots_in_use=sum(h.ledger.held for h in coordinator.handles),
            elapsed_seconds=time.monotonic() - self._started,
            time_to_first_batch=self._first_batch,
        )

    # ------------------------------------------------------------------------------ internals
    def _check_ranks_at_start(self) -> None:
        """Across ranks (when a process group is up): the same configuration and epoch length."""
        coordinator = self._coordinator
        assert coordinator is not None
        steps = [h.hello.steps_per_epoch if h.hello else None for h in coordinator.handles]
        payload = {
            "batch_size": self.batch_size,
            "num_workers": self.num_workers,
            "seed": self.seed,
            "capture": self.capture,
            "device": self.device,
            "num_threads": self.num_threads,
            "prefetch": self.prefetch,
            "loader_version": _version(),
            "steps_per_epoch": None if None in steps else sum(s for s in steps if s is not None),
        }
        try:
            _distributed.check_ranks("configuration", _distributed.gather(payload))
        except BaseException:
            self.close()
            raise

    def _check_ranks_traced(self) -> None:
        """Across ranks, once per loader: the traced signature (outputs, capture, DALI)."""
        coordinator = self._coordinator
        assert coordinator is not None
        self._ranks_traced = True
        reference = coordinator.reference
        payload = {} if reference is None else dict(reference.agreement_fields())
        payload.pop("device_id", None)  # each rank drives its own GPU
        try:
            _distributed.check_ranks("traced signature", _distributed.gather(payload))
        except BaseException as error:
            coordinator.failure = error
            coordinator.close()
            raise

    def _require_open(self) -> Coordinator:
        coordinator = self._coordinator
        if coordinator is not None and coordinator.failure is not None:
            raise LoaderClosedError(
                f"the loader was shut down after a failure: {coordinator.failure}"
            ) from coordinator.failure
        if self._closed or coordinator is None or coordinator.pool.closed:
            raise LoaderClosedError("the loader is closed")
        return coordinator

    def _abort(self, run: _EpochIterator) -> None:
        """Stop ``run`` in every worker and wait until each has rebuilt its sources."""
        coordinator = self._require_open()
        run.finished = True
        for handle in coordinator.handles:
            handle.epoch = None
            while handle.queue:
                coordinator.release_now(handle, handle.queue.popleft())
            handle.aborted_epoch = None
        coordinator.send_all(wire.AbortEpoch(run.epoch))
        for handle in coordinator.handles:
            while handle.aborted_epoch != run.epoch:
                coordinator.pump(handle, self._trace_timeout)  # includes rebuilding the source
        coordinator.pending_signatures = {h.index for h in coordinator.handles}
        logger.info("epoch %d was left early; workers rebuilt their sources", run.epoch)

    def _next(self, run: _EpochIterator) -> Any:
        coordinator = self._require_open()
        if run.finished:
            raise StopIteration
        if self._current is not run:
            raise RuntimeError(
                "this epoch iterator was replaced by a newer iter(loader); "
                "iterate one epoch at a time"
            )
        while coordinator.pending_signatures:
            # A worker's first step traces (and may parse source files): it is bounded by
            # startup_timeout, not by the per-batch timeout.
            waiting = coordinator.handles[min(coordinator.pending_signatures)]
            coordinator.pump(waiting, self._trace_timeout)
        if not self._ranks_traced:
            self._check_ranks_traced()
        handles = coordinator.handles
        count = len(handles)
        while True:
            chosen = None
            for offset in range(count):
                handle = handles[(run.cursor + offset) % count]
                if handle.queue or handle.ended_epoch != run.epoch:
                    chosen = handle
                    break
            if chosen is None:
                run.finished = True
                raise StopIteration
            if chosen.queue:
                coordinator.flush_releases(lazy=True)
                descriptor = chosen.queue.popleft()
                run.cursor = (chosen.index + 1) % count
                return self._deliver(chosen, descriptor)
            if chosen.ledger.all_held:
                coordinator.flush_releases()
                if chosen.ledger.all_held:
                    coordinator.collect_views(chosen)
            if not coordinator.take_ready(chosen):
                coordinator.pump(chosen, self.timeout)

    def _deliver(self, handle: Any, descriptor: wire.BatchReady) -> Any:
        coordinator = self._coordinator
        assert coordinator is not None
        if self._kind is None:
            reference = coordinator.reference or handle.signature
            self._kind = reference.output_kind if reference is not None else "dict"
        info = BatchInfo(
            epoch=descriptor.epoch,
            step=descriptor.step,
            worker=handle.index,
            shard=handle.shard.index,
            padded=descriptor.padded,
        )
        cuda = handle.cuda
        if cuda is not None and descriptor.arena_id == cuda.arena_id:
            assert coordinator.cuda_stream is not None
            batch, release = build_cuda_batch(
                descriptor,
                cuda,
                self._kind,
                info,
                output=self.output,
                copy=self.copy,
                releases=coordinator.releases,
                stream=coordinator.cuda_stream(cuda.device_id),
            )
        else:
            assert handle.arena is not None
            batch, release = build_batch(
                descriptor,
                handle.arena,
                self._kind,
                info,
                output=self.output,
                copy=self.copy,
                releases=coordinator.releases,
            )
        if release:
            coordinator.release_now(handle, descriptor)
        self._batches += 1
        if self._first_batch is None:
            self._first_batch = time.monotonic() - self._started
        return batch


class _EpochIterator:
    """One epoch of a Loader. Obtained from ``iter(loader)``."""

    def __init__(self, loader: Loader, epoch: int) -> None:
        self._loader = loader
        self.epoch = epoch
        self.cursor = 0
        self.finished = False

    def __iter__(self) -> _EpochIterator:
        return self

    def __next__(self) -> Any:
        return self._loader._next(self)


def _version() -> str:
    from . import __version__

    return __version__


def _require_gpu() -> int:
    """The number of GPUs CUDA can see; raises a clear error when there is none."""
    import ctypes

    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        count = ctypes.c_int(0)
        if libcuda.cuInit(0) != 0 or libcuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
            raise OSError("cuInit failed")
    except OSError:
        raise RuntimeError(
            "device='gpu' needs an NVIDIA GPU and its driver, and none was found "
            "(check nvidia-smi and CUDA_VISIBLE_DEVICES); use device='cpu'"
        ) from None
    if count.value < 1:
        raise RuntimeError(
            "device='gpu' needs an NVIDIA GPU, but CUDA sees none "
            "(check CUDA_VISIBLE_DEVICES); use device='cpu'"
        )
    return int(count.value)
