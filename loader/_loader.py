"""``Loader``: the user's iterable over batches made by worker processes. Runs in the trainer.

Order: within an epoch, batches come round-robin over workers (worker 0's first batch, worker 1's
first, ..., worker 0's second, ...), skipping workers whose shard has ended. The trainer always
waits for the specific worker whose turn it is, so the sequence depends only on the seed.

Epochs follow the conventions every trainer assumes (torch's ``DataLoader``, Lightning,
accelerate): ``len(loader)`` is the epoch's length; ``iter(loader)`` is lazy (nothing reaches a
worker until the first ``next()``, and an iterator thrown away changes nothing); an iterator that
has delivered its epoch's last batch is finished even if nobody calls ``next()`` again, so the
next ``iter(loader)`` goes on with the next epoch, which the workers already prefetch. Leaving an
epoch early and starting another aborts it everywhere first: every worker stops its loop,
rebuilds its source and feeders for the next epoch (so DALI re-traces), and acknowledges.

The Loader holds no worker state: it asks the coordinator (:mod:`loader._coordinator`), which
owns every worker's lifecycle.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ipc.wire import Sampling
from workers import Shard

from . import _checkpoint, _distributed, _env
from ._checkpoint import Resume
from ._config import LoaderConfig
from ._coordinator import Coordinator
from ._errors import LoaderClosedError, SkipLimitError
from ._pool import WorkerPool
from ._session import WorkerSession
from ._validate import check_not_importing_main
from ._views import BatchInfo, build_batch, current_stream, register_pytree_nodes

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
        self._epoch = 0
        self._current: _EpochIterator | None = None
        self._batches = 0
        self._samples = 0
        self._kind: str | None = None
        self._ranks_traced = False
        self._ranks_checked = False
        self._ranks_checked_later = False  # re-laid: agreement is checked at the first epoch
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
        self._launch(config)

    def _launch(self, config: LoaderConfig) -> None:
        """Start ``config``'s workers and wait until each is ready (raises, closed, if not)."""
        self.config = config
        if config.output == "torch":
            register_pytree_nodes()
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
        try:
            coordinator.start(config.startup_timeout)
        except BaseException:
            self.close()
            raise
        self._ready_at = time.monotonic()
        self._startup_wait_ns = coordinator.wait_ns
        if config.on_error == "skip" or config.max_restarts:
            self._check_healable()
        if _distributed.group_size() > 1 and not self._ranks_checked_later:
            self._check_ranks_at_start()  # a collective: only where every rank builds one
        logger.info(
            "started %d workers (rank %d/%d%s, %d DALI threads each, capture=%s)",
            config.num_workers,
            config.rank,
            config.world_size,
            ", until a process group says otherwise" if config.placement.provisional else "",
            config.num_threads,
            config.capture,
        )

    def _settle(self) -> Coordinator:
        """Rank and world size, final once a process group is up: a loader built before the
        launcher set one up (Lightning's DDP, a DataModule's ``__init__``) re-lays its workers
        for the group's rank before its first epoch. Costs nothing once settled."""
        coordinator = self._require_open()
        config = self.config
        if config.placement_source == "torch.distributed" or (
            not config.placement.provisional and _distributed.group_size() == 0
        ):
            return coordinator
        try:
            placement = _env.settle_placement(config.placement)
        except ValueError:
            self.close()
            raise
        if placement is None:
            return coordinator
        if (placement.rank, placement.world_size) == (config.rank, config.world_size):
            self.config = config.placed(placement)  # confirmed: nothing to re-lay
            return coordinator
        started = self._current is not None and self._current.started
        if started or self._resume is not None:
            self.close()
            raise RuntimeError(
                f"the torch.distributed group makes this loader rank {placement.rank} of "
                f"{placement.world_size}, but it already ran or resumed an epoch as rank "
                f"{config.rank} of {config.world_size}: set the process group up before the "
                "first epoch, or build the Loader after it (e.g. in train_dataloader())"
            )
        logger.info(
            "rank %d of %d from the process group (the loader was built as rank %d of %d): "
            "restarting its workers for that shard",
            placement.rank,
            placement.world_size,
            config.rank,
            config.world_size,
        )
        if self._finalizer is not None:
            self._finalizer()
        # no collective in here: other ranks may be settling without a re-lay
        self._ranks_checked_later = True
        self._launch(config.placed(placement))
        return self._require_open()

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
        """An iterator over the next epoch. Lazy: the epoch starts at its first ``next()``, so
        an iterator thrown away (Lightning makes one to check the loader) changes nothing.
        Starting another while an epoch is half-delivered ends that epoch early everywhere."""
        self._require_open()
        current = self._current
        if current is not None:
            current.leave_accelerate()
        if current is not None and current.started and not current.finished:
            self._abort(current)
        elif current is not None and not current.started:
            current.replaced = True
        run = _EpochIterator(self, self._epoch)
        self._current = run
        return run

    def __len__(self) -> int:
        """Batches this rank gets per epoch, the same on every rank (known for
        :func:`sharded_source`, :func:`sharded_files` and readers that stick to their shard).

        As for torch's ``DataLoader``, it is the epoch's length even in an epoch resumed by
        :meth:`load_state_dict`: the batches this rank had received before the save plus those
        left, which the resumed iterator yields (a trainer that restores its own count of
        batches done stops after ``len()`` exactly). Resumed on another layout, it is at least
        the new layout's epoch length (the iterator then ends before ``len()``, as a trainer
        expects of a shorter epoch). :meth:`remaining` gives the batches left.
        """
        self._settle()
        epoch = self._active_epoch()
        resume = self._resume
        full = self._epoch_length()
        if resume is not None and resume.epoch == epoch:
            resumed = resume.before + sum(self._resume_steps)
            # Another layout: the saving ranks' count plus what is left can be shorter than
            # this layout's epochs. Lightning keeps the length it reads after the resume for
            # every later epoch (it would cut them short), and ends an epoch early at the
            # iterator's end: the longer of the two loses nothing.
            return resumed if resume.continues else max(full, resumed)
        return full

    def remaining(self) -> int:
        """Batches still to come in the epoch in progress (between epochs: in the next one,
        which is shorter than ``len()`` after :meth:`load_state_dict`)."""
        self._settle()
        current = self._current
        if current is not None and current.started and not current.finished:
            if current.expected is None:
                self._epoch_length()  # raises: unknown for this source
            assert current.expected is not None
            return current.expected - current.delivered
        resume = self._resume
        if resume is not None and resume.epoch == self._epoch:
            return sum(self._resume_steps)
        return self._epoch_length()

    def state_dict(self) -> dict[str, Any]:
        """Where the loader stands: a small JSON-serialisable dict (O(shards)) to save with a
        checkpoint and give to :meth:`load_state_dict`.

        It counts, per global shard, the batches the trainer has received (handed out by the
        iterator; prefetched ones do not count) in the epoch in progress; once an epoch's last
        batch was handed out, it describes the next epoch with nothing received (whether or not
        ``next()`` was called again). With a ``torch.distributed`` group up it is a collective:
        every rank calls it and gets the same global dict; without one it describes this rank's
        shards. Costs no message to the workers. Needs :func:`sharded_source` or
        :func:`sharded_files`.
        """
        coordinator = self._settle()
        sampling = self._sampling()
        current = self._current
        resume = self._resume
        shard_indices = [shard.index for shard in self.config.shards]
        epoch = self._active_epoch()
        before = 0
        if resume is not None and resume.epoch == epoch:
            offsets, history = resume.offsets(shard_indices), resume.history()
            before = resume.before
        else:
            offsets, history = [0] * len(shard_indices), []
        if current is not None and current.started and not current.finished:
            delivered = [s.delivered for s in coordinator.sessions]
        else:
            delivered = [0] * len(shard_indices)
        mine = [o + d for o, d in zip(offsets, delivered, strict=True)]
        steps = before + sum(delivered)
        config = self.config
        gathered = _distributed.gather(
            {"rank": config.rank, "received": mine, "epoch": epoch, "steps": steps}
        )
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
        rank_steps: list[int | None] = [None] * config.world_size
        for part in gathered or [{"rank": config.rank, "steps": steps}]:
            rank_steps[int(part["rank"])] = int(part["steps"])
        return _checkpoint.make_state(
            sampling=sampling,
            epoch=epoch,
            world_size=config.world_size,
            num_workers=config.num_workers,
            received=received,
            history=history,
            steps=rank_steps,
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
        coordinator = self._settle()
        config = self.config
        resume = _checkpoint.parse_state(
            state,
            sampling=self._sampling(),
            world_size=config.world_size,
            num_workers=config.num_workers,
            rank=config.rank,
        )
        current = self._current
        if current is not None and current.started and not current.finished:
            self._abort(current)
            self._current = None
        steps = coordinator.seek(resume.epoch, resume.segments, resume.continues)
        self._resume, self._resume_steps = resume, steps
        self._epoch = resume.epoch
        try:
            _distributed.check_ranks(
                "resumed epoch length", _distributed.gather({"steps": sum(steps)})
            )
        except BaseException:
            self.close()
            raise
        logger.info(
            "resuming epoch %d at %s (%s layout): %d batches received before, %d left on this rank",
            resume.epoch,
            list(resume.segments[-1][1]),
            "same" if resume.continues else "new",
            resume.before,
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

    def _sampling(self) -> Sampling:
        coordinator = self._require_open()
        found = {s.hello.sampling if s.hello else None for s in coordinator.sessions}
        if None in found or len(found) != 1:
            raise TypeError(_checkpoint.NOT_RESUMABLE)
        sampling = next(iter(found))
        assert sampling is not None
        return sampling

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
        current = self._current
        if current is not None and current.finished and not self.closed:
            # an epoch over by count: its end (with the workers' counters) is on its way
            coordinator.finish_epoch()
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
        self._ranks_checked = True
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

    def _active_epoch(self) -> int:
        """The epoch in progress, or between epochs the next one."""
        current = self._current
        if current is not None and current.started and not current.finished:
            return current.epoch
        return self._epoch

    def _epoch_length(self) -> int:
        """Batches of a whole epoch on this rank; ``TypeError`` when the source cannot say."""
        coordinator = self._require_open()
        steps = [s.hello.steps_per_epoch if s.hello else None for s in coordinator.sessions]
        if any(s is None for s in steps):
            raise TypeError(
                "len(loader) is unknown for this source: use sharded_source(), or a reader built "
                "with stick_to_shard=True and pad_last_batch=True (every sample once per epoch, "
                "padded rows flagged in batch.info.padded)"
            )
        return sum(s for s in steps if s is not None)

    def _start(self, run: _EpochIterator) -> Coordinator:
        """The first ``next()`` of ``run``: settle the rank, start the epoch in every worker."""
        coordinator = self._settle()
        if not self._ranks_checked and _distributed.group_size() > 1:
            self._check_ranks_at_start()
        run.epoch = epoch = self._epoch
        resume = self._resume
        if resume is not None and resume.epoch != epoch:
            self._resume = resume = None  # that epoch is over (or was left for a newer one)
        base: list[int] | None = None
        if resume is not None:
            # round robin as if never interrupted: the next worker is the first of those that
            # received the fewest batches of this rank
            base = resume.offsets([shard.index for shard in self.config.shards])
            run.cursor = base.index(min(base))
            run.expected = sum(self._resume_steps)
        else:
            steps = [s.hello.steps_per_epoch if s.hello else None for s in coordinator.sessions]
            run.expected = None if None in steps else sum(s for s in steps if s is not None)
        coordinator.start_epoch(epoch, base)
        run.started = True
        self._epoch += 1
        if self._iterating_since is None:
            self._iterating_since = time.monotonic()
        run.accelerate = _accelerate_state()
        if run.accelerate is not None:
            run.accelerate._add_dataloader(run)
        return coordinator

    def _finish(self, run: _EpochIterator) -> None:
        run.finished = True
        self._last_batch_at = time.monotonic()  # iteration lasts until the epoch's end

    def _next(self, run: _EpochIterator) -> Any:
        coordinator = self._require_open()
        if run.replaced:
            raise RuntimeError(
                f"this iterator of epoch {run.epoch} was replaced by a newer iter(loader) or "
                "load_state_dict(); iterate one epoch at a time"
            )
        if run.finished:
            run.leave_accelerate()
            raise StopIteration
        if not run.started:
            coordinator = self._start(run)
        if run.expected is not None and run.delivered >= run.expected:
            self._finish(run)  # nothing left (a state saved at its epoch's end)
            run.leave_accelerate()
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
            self._finish(run)
            run.leave_accelerate()
            raise StopIteration
        session, descriptor = found
        run.cursor = (session.index + 1) % len(coordinator.sessions)
        run.delivered += 1
        if run.expected is not None and run.delivered >= run.expected:
            # the epoch's last batch: the epoch is over now, not at a next() that a trainer
            # stopping after len() batches never makes
            self._finish(run)
            run.end_of_dataloader = True
        return self._deliver(coordinator, session, descriptor)

    def _deliver(self, coordinator: Coordinator, session: WorkerSession, descriptor: Any) -> Any:
        if self._kind is None:
            reference = coordinator.reference or session.signature
            self._kind = reference.output_kind if reference is not None else "dict"
        info = BatchInfo(
            epoch=descriptor.epoch,
            step=session.epoch_step(descriptor.step),
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
    """One epoch of a Loader. Obtained from ``iter(loader)``; started by its first ``next()``.

    ``len(iterator)`` is the number of batches it still yields. It also speaks accelerate's
    dataloader protocol (``end_of_dataloader``, ``remainder``): under an ``Accelerator`` with
    gradient accumulation, gradients are synchronised at the epoch's last batch.
    """

    def __init__(self, loader: Loader, epoch: int) -> None:
        self._loader = loader
        self.epoch = epoch  # settled when it starts
        self.cursor = 0
        self.started = False
        self.finished = False
        self.replaced = False
        self.delivered = 0  # batches handed out by this iterator
        self.expected: int | None = None  # batches it hands out in all, when known
        self.end_of_dataloader = False  # accelerate: the last batch was handed out
        self.remainder = -1  # accelerate: no samples of the last batch are duplicates to drop
        self.accelerate: Any = None  # accelerate's GradientState, while registered with it

    def __iter__(self) -> _EpochIterator:
        return self

    def __next__(self) -> Any:
        return self._loader._next(self)

    def __len__(self) -> int:
        if self.finished or self.replaced:
            return 0
        if self.started:
            if self.expected is None:
                raise TypeError("the length of this epoch is unknown for this source")
            return self.expected - self.delivered
        return self._loader.remaining()

    def leave_accelerate(self) -> None:
        if self.accelerate is not None:
            with contextlib.suppress(ValueError):
                self.accelerate._remove_dataloader(self)
            self.accelerate = None


def _accelerate_state() -> Any:
    """accelerate's ``GradientState`` when an ``Accelerator`` exists in this process, else None
    (nothing of accelerate is imported or created here)."""
    state = sys.modules.get("accelerate.state")
    gradient_state = getattr(state, "GradientState", None)
    if gradient_state is None or not getattr(gradient_state, "_shared_state", None):
        return None
    try:
        return gradient_state()
    except Exception:  # another accelerate version: the protocol is an extra, not a must
        return None


def _version() -> str:
    from . import __version__

    return __version__
