"""``Loader``: the user's iterable over batches made by worker processes. Runs in the trainer.

Order: within an epoch, batches come round-robin over workers (worker 0's first batch, worker 1's
first, ..., worker 0's second, ...), skipping workers whose shard has ended. The trainer always
waits for the specific worker whose turn it is, so the sequence depends only on the seed.

Epochs: ``iter(loader)`` starts the next epoch in every worker. Leaving an epoch early and calling
``iter`` again aborts it everywhere first: every worker stops its loop, rebuilds its source and
feeders for the next epoch (so DALI re-traces), and acknowledges; only then does the next epoch
start, complete and from the start of every shard.

The Loader holds no worker state: it asks the coordinator (:mod:`loader._coordinator`), which
owns every worker's lifecycle.
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from workers import Shard

from . import _checkpoint, _distributed
from ._checkpoint import Resume, SamplingInfo
from ._config import LoaderConfig
from ._coordinator import Coordinator
from ._errors import LoaderClosedError, SkipLimitError
from ._pool import WorkerPool
from ._session import WorkerSession
from ._validate import check_not_importing_main
from ._views import BatchInfo, build_batch, current_stream

logger = logging.getLogger("loader")


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
    batches_per_second: float  # batches per second of the worker's busy time
    bytes: int
    restarts: int = 0  # times this worker's process was replaced


@dataclass(frozen=True)
class LoaderStats:
    """Counters of one loader. ``startup_seconds`` (construction until every worker is ready)
    is kept apart from ``iteration_seconds`` (the first ``iter(loader)`` until the latest
    delivered batch or epoch end), which the rates are computed over."""

    workers: tuple[WorkerStats, ...]
    batches: int
    samples: int  # real samples delivered (padded and replaced rows are not counted)
    bytes_moved: int
    wait_seconds: float  # the trainer's time waiting for workers after startup
    slots_in_use: int
    skipped: tuple[tuple[int, str], ...]  # (sample id, name) of each sample skipped, once
    restarts: int  # worker processes replaced so far
    startup_seconds: float
    iteration_seconds: float
    time_to_first_batch: float | None  # from the first iter(loader)

    @property
    def samples_per_second(self) -> float:
        return 0.0 if self.iteration_seconds <= 0 else self.samples / self.iteration_seconds

    @property
    def batches_per_second(self) -> float:
        return 0.0 if self.iteration_seconds <= 0 else self.batches / self.iteration_seconds


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
        max_restarts: int = 0,
        on_error: str = "raise",
        max_skipped: int | None = None,
        in_order: bool = True,
    ) -> None:
        self._closed = True  # until the pool is up; close() must work on a half-built loader
        self._coordinator: Coordinator | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None
        check_not_importing_main()
        config = LoaderConfig.build(
            source,
            step,
            batch_size=batch_size,
            num_workers=num_workers,
            feeders=feeders,
            device=device,
            device_id=device_id,
            num_threads=num_threads,
            prefetch=prefetch,
            output=output,
            copy=copy,
            capture=capture,
            seed=seed,
            timeout=timeout,
            start_method=start_method,
            rank=rank,
            world_size=world_size,
            startup_timeout=startup_timeout,
            shm_limit=shm_limit,
            max_restarts=max_restarts,
            on_error=on_error,
            max_skipped=max_skipped,
            in_order=in_order,
        )
        self.config = config
        pool = WorkerPool(config.worker_specs(), config.start_method)
        trace_timeout = None if config.timeout is None else config.startup_timeout
        coordinator = Coordinator(
            pool,
            timeout=config.timeout,
            trace_timeout=trace_timeout,
            stream_of=current_stream(config.output) if config.device == "gpu" else None,
            max_restarts=config.max_restarts,
            startup_timeout=config.startup_timeout,
            in_order=config.in_order,
        )
        self._coordinator = coordinator
        self._finalizer = weakref.finalize(self, coordinator.close)
        self._closed = False
        self._epoch = 0
        self._current: _EpochIterator | None = None
        self._batches = 0
        self._samples = 0
        self._kind: str | None = None
        self._ranks_traced = False
        self._created = time.monotonic()
        self._ready_at: float | None = None
        self._iterating_since: float | None = None
        self._last_batch_at: float | None = None
        self._first_batch: float | None = None
        self._startup_wait_ns = 0
        self._resume: Resume | None = None  # a loaded state, until its epoch is over
        self._resume_steps: list[int] = []  # batches each worker has left in that epoch
        self._skipped: dict[int, str] = {}  # sample id -> name, every sample skipped so far
        self._epoch_skips = (0, 0)  # (epoch, samples skipped in it so far)
        try:
            coordinator.start(config.startup_timeout)
        except BaseException:
            self.close()
            raise
        self._ready_at = time.monotonic()
        self._startup_wait_ns = coordinator.wait_ns
        if config.on_error == "skip" or config.max_restarts:
            self._check_healable()
        self._check_ranks_at_start()
        logger.info(
            "started %d workers (rank %d/%d, %d DALI threads each, capture=%s)",
            config.num_workers,
            config.rank,
            config.world_size,
            config.num_threads,
            config.capture,
        )

    # ------------------------------------------------------------------------------ settings
    # Read-only views of ``config`` (a frozen LoaderConfig), for the user's convenience.
    batch_size = property(lambda self: self.config.batch_size, doc="Samples per batch.")
    num_workers = property(lambda self: self.config.num_workers, doc="Workers of this rank.")
    num_slots = property(lambda self: self.config.num_slots, doc="Slots per worker.")
    num_threads = property(lambda self: self.config.num_threads, doc="DALI threads per worker.")
    prefetch = property(lambda self: self.config.prefetch, doc="Batches ahead per worker.")
    device = property(lambda self: self.config.device, doc="'cpu' or 'gpu'.")
    device_id = property(lambda self: self.config.device_id, doc="The GPU, with device='gpu'.")
    output = property(lambda self: self.config.output, doc="'numpy', 'torch' or 'cupy'.")
    copy = property(lambda self: self.config.copy, doc="Private copies instead of views.")
    capture = property(lambda self: self.config.capture, doc="DALI capture mode in workers.")
    seed = property(lambda self: self.config.seed, doc="The loader's seed.")
    timeout = property(lambda self: self.config.timeout, doc="Seconds per batch, or None.")
    rank = property(lambda self: self.config.rank, doc="This trainer's rank.")
    world_size = property(lambda self: self.config.world_size, doc="Ranks in the job.")
    shards = property(lambda self: self.config.shards, doc="This rank's shards, per worker.")

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
        resume = self._resume
        if resume is not None and resume.epoch != run.epoch:
            self._resume = resume = None  # that epoch is over (or was left for a newer one)
        if resume is not None:
            # round robin as if never interrupted: the next worker is the first of those that
            # received the fewest batches of this rank
            offsets = resume.offsets([shard.index for shard in self.config.shards])
            run.cursor = offsets.index(min(offsets))
        self._current = run
        coordinator.start_epoch(run.epoch)
        self._epoch += 1
        if self._iterating_since is None:
            self._iterating_since = time.monotonic()
        return run

    def __len__(self) -> int:
        """Batches this rank gets per epoch (known for :func:`sharded_source`,
        :func:`sharded_files` and readers that stick to their shard); for an epoch resumed by
        :meth:`load_state_dict`, the batches left in it."""
        coordinator = self._require_open()
        current = self._current
        epoch = current.epoch if current is not None and not current.finished else self._epoch
        if self._resume is not None and self._resume.epoch == epoch:
            return sum(self._resume_steps)
        steps = [s.hello.steps_per_epoch if s.hello else None for s in coordinator.sessions]
        if any(s is None for s in steps):
            raise TypeError(
                "len(loader) is unknown for this source: use sharded_source(), or a reader built "
                "with stick_to_shard=True and pad_last_batch=True (every sample once per epoch, "
                "padded rows flagged in batch.info.padded)"
            )
        return sum(s for s in steps if s is not None)

    def state_dict(self) -> dict[str, Any]:
        """Where the loader stands: a small JSON-serialisable dict (O(shards)) to save with a
        checkpoint and give to :meth:`load_state_dict`.

        It counts, per global shard, the batches the trainer has received (handed out by the
        iterator; prefetched ones do not count) in the epoch in progress (or, between epochs,
        the next one). With a ``torch.distributed`` group up it is a collective: every rank calls
        it and gets the same global dict; without one it describes this rank's shards. Costs no
        message to the workers. Needs :func:`sharded_source` or :func:`sharded_files`.
        """
        coordinator = self._require_open()
        sampling = self._sampling()
        current = self._current
        resume = self._resume
        shard_indices = [shard.index for shard in self.config.shards]
        if current is not None and not current.finished:
            epoch = current.epoch
            if resume is not None and resume.epoch == epoch:
                offsets, history = resume.offsets(shard_indices), resume.history()
            else:
                offsets, history = [0] * len(shard_indices), []
            mine = [o + s.delivered for o, s in zip(offsets, coordinator.sessions, strict=True)]
        else:
            epoch = self._epoch
            if resume is not None and resume.epoch == epoch:  # loaded, not started yet
                offsets, history = resume.offsets(shard_indices), resume.history()
                mine = offsets
            else:
                mine, history = [0] * len(shard_indices), []
        config = self.config
        gathered = _distributed.gather({"rank": config.rank, "received": mine, "epoch": epoch})
        if gathered is not None:
            epochs = {part["epoch"] for part in gathered}
            if len(epochs) > 1:
                raise RuntimeError(
                    f"ranks are in different epochs ({sorted(epochs)}): call state_dict() on "
                    "every rank at the same step"
                )
        received = _checkpoint.merge_ranks(
            mine, config.rank, config.num_workers, config.world_size, gathered
        )
        return _checkpoint.make_state(
            sampling=sampling,
            epoch=epoch,
            world_size=config.world_size,
            num_workers=config.num_workers,
            received=received,
            history=history,
        )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a state of :meth:`state_dict`, on this or another layout.

        Call it before the next ``iter(loader)``: that epoch continues at the first batch not
        yet received (no batch before it is read), and later epochs run as if there had been no
        interruption. On the same world size and workers the stream of batches equals the
        uninterrupted one; on another layout the samples not yet received are split evenly
        among the new shards (padding flagged), every rank the same number of steps. A state
        that cannot apply (another dataset size, seed or batch size, a newer format) raises
        ``ValueError`` naming the field, before any worker does anything.
        """
        coordinator = self._require_open()
        config = self.config
        resume = _checkpoint.parse_state(
            state,
            sampling=self._sampling(),
            world_size=config.world_size,
            num_workers=config.num_workers,
            rank=config.rank,
        )
        if self._current is not None and not self._current.finished:
            self._abort(self._current)
        steps = coordinator.seek(resume.epoch, resume.segments, resume.continues)
        self._resume, self._resume_steps = resume, steps
        self._epoch = resume.epoch
        self._current = None
        try:
            _distributed.check_ranks(
                "resumed epoch length", _distributed.gather({"steps": sum(steps)})
            )
        except BaseException:
            self.close()
            raise
        logger.info(
            "resuming epoch %d at %s (%s layout): %d batches left on this rank",
            resume.epoch,
            list(resume.segments[-1][1]),
            "same" if resume.continues else "new",
            sum(steps),
        )

    def _check_healable(self) -> None:
        """on_error="skip" needs sample ids: a sharded_source/sharded_files root."""
        coordinator = self._coordinator
        assert coordinator is not None
        positional = all(s.hello is not None and s.hello.sampling for s in coordinator.sessions)
        if self.config.on_error == "skip" and not positional:
            self.close()
            raise ValueError(
                "on_error='skip' needs a source that knows its sample ids: sharded_files() or "
                "sharded_source(); a DALI reader cannot leave a sample out (its pipeline is "
                "disabled by any error)"
            )
        if self.config.max_restarts and not positional:
            logger.warning(
                "max_restarts=%d, but the source is a DALI reader (or a plain ExternalSource), "
                "which cannot start mid-shard: a dead worker will raise, not be replaced. Use "
                "sharded_files() or sharded_source() to heal",
                self.config.max_restarts,
            )

    def _note_skipped(self, descriptor: Any) -> None:
        """Count skipped samples; more than ``max_skipped`` in an epoch is a pipeline bug."""
        for index, name in zip(descriptor.skipped, descriptor.skipped_names, strict=True):
            self._skipped.setdefault(index, name)
        epoch, count = self._epoch_skips
        count = (count if epoch == descriptor.epoch else 0) + len(descriptor.skipped)
        self._epoch_skips = (descriptor.epoch, count)
        limit = self._max_skipped()
        if count > limit:
            error = SkipLimitError(
                f"{count} samples were skipped in epoch {descriptor.epoch}, more than "
                f"max_skipped={limit}: that is a pipeline bug, not bad data (last: "
                f"{descriptor.skipped_names[-1]}). Fix step() or the data, or raise max_skipped="
            )
            coordinator = self._coordinator
            assert coordinator is not None
            coordinator.failure = error
            coordinator.close()
            raise error

    def _max_skipped(self) -> int:
        """``max_skipped``, by default 1% of an epoch's samples (at least 8)."""
        if self.config.max_skipped is not None:
            return self.config.max_skipped
        return max(8, math.ceil(0.01 * self._sampling().total))

    def _sampling(self) -> SamplingInfo:
        coordinator = self._require_open()
        found = {s.hello.sampling if s.hello else None for s in coordinator.sessions}
        if None in found or len(found) != 1:
            raise TypeError(_checkpoint.NOT_RESUMABLE)
        total, batch_size, seed, shuffle, drop_last = next(iter(found))  # type: ignore[misc]
        return SamplingInfo(total, batch_size, seed, shuffle, drop_last)

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
        return [s.handle.pid for s in coordinator.sessions if s.handle.pid is not None]

    def stats(self) -> LoaderStats:
        """A snapshot of per-worker and trainer-side counters."""
        coordinator = self._coordinator
        assert coordinator is not None
        workers = []
        for session in coordinator.sessions:
            counters = session.counters
            busy = counters.busy_ns / 1e9
            workers.append(
                WorkerStats(
                    worker=session.index,
                    shard=session.shard.index,
                    pid=session.handle.pid,
                    steps=counters.steps,
                    traces=counters.traces,
                    rebuilds=counters.rebuilds,
                    trace_seconds=tuple(counters.trace_seconds),
                    busy_seconds=busy,
                    blocked_seconds=counters.blocked_ns / 1e9,
                    batches_per_second=counters.steps / busy if busy > 0 else 0.0,
                    bytes=counters.bytes,
                    restarts=counters.restarts,
                )
            )
        ready = self._ready_at if self._ready_at is not None else time.monotonic()
        iterating = 0.0
        if self._iterating_since is not None and self._last_batch_at is not None:
            iterating = self._last_batch_at - self._iterating_since
        return LoaderStats(
            workers=tuple(workers),
            batches=self._batches,
            samples=self._samples,
            bytes_moved=sum(w.bytes for w in workers),
            wait_seconds=(coordinator.wait_ns - self._startup_wait_ns) / 1e9,
            slots_in_use=sum(s.reader.held for s in coordinator.sessions),
            skipped=tuple(self._skipped.items()),
            restarts=coordinator.restarts,
            startup_seconds=ready - self._created,
            iteration_seconds=iterating,
            time_to_first_batch=self._first_batch,
        )

    # ------------------------------------------------------------------------------ internals
    def _check_ranks_at_start(self) -> None:
        """Across ranks (when a process group is up): the same configuration and epoch length."""
        coordinator = self._coordinator
        assert coordinator is not None
        steps = [s.hello.steps_per_epoch if s.hello else None for s in coordinator.sessions]
        payload = {
            **self.config.agreement_payload(),
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
        run.replaced = True
        coordinator.abort_epoch(run.epoch)
        logger.info("epoch %d was left early; workers rebuilt their sources", run.epoch)

    def _next(self, run: _EpochIterator) -> Any:
        coordinator = self._require_open()
        if run.replaced:
            raise RuntimeError(
                f"this iterator of epoch {run.epoch} was replaced by a newer iter(loader), which "
                "ended that epoch early; iterate one epoch at a time"
            )
        if run.finished:
            raise StopIteration
        coordinator.wait_signatures()
        if not self._ranks_traced:
            self._check_ranks_traced()
        found = (
            coordinator.next_batch(run.cursor)
            if self.config.in_order
            else coordinator.next_ready_batch()
        )
        if found is None:
            run.finished = True
            self._last_batch_at = time.monotonic()  # iteration lasts until the epoch's end
            raise StopIteration
        session, descriptor = found
        run.cursor = (session.index + 1) % len(coordinator.sessions)
        return self._deliver(coordinator, session, descriptor)

    def _deliver(self, coordinator: Coordinator, session: WorkerSession, descriptor: Any) -> Any:
        if self._kind is None:
            reference = coordinator.reference or session.signature
            self._kind = reference.output_kind if reference is not None else "dict"
        info = BatchInfo(
            epoch=descriptor.epoch,
            step=descriptor.step + session.step_offset,
            worker=session.index,
            shard=session.shard.index,
            padded=descriptor.padded,
            replaced=descriptor.replaced,
            skipped=descriptor.skipped,
            skipped_names=descriptor.skipped_names,
        )
        if descriptor.skipped:
            self._note_skipped(descriptor)
        arrays, lease = session.reader.arrays(descriptor)
        copy = self.config.copy
        batch = build_batch(
            arrays,
            lease,
            descriptor,
            self._kind,
            info,
            output=self.config.output,
            copy=copy,
            releases=coordinator.releases,
            owner=session.reader,
        )
        del arrays, lease
        if copy:
            coordinator.release_now(session, descriptor)
        self._batches += 1
        real = self.config.batch_size - descriptor.padded
        # a row filled in for a skipped sample (on_error="skip") is a repeat, like padding
        self._samples += real - sum(1 for row in descriptor.replaced if row < real)
        now = time.monotonic()
        self._last_batch_at = now
        if self._first_batch is None and self._iterating_since is not None:
            self._first_batch = now - self._iterating_since
        return batch


class _EpochIterator:
    """One epoch of a Loader. Obtained from ``iter(loader)``."""

    def __init__(self, loader: Loader, epoch: int) -> None:
        self._loader = loader
        self.epoch = epoch
        self.cursor = 0
        self.finished = False
        self.replaced = False

    def __iter__(self) -> _EpochIterator:
        return self

    def __next__(self) -> Any:
        return self._loader._next(self)


def _version() -> str:
    from . import __version__

    return __version__
