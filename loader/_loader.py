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
``set_epoch(e)`` (torch's ``DistributedSampler`` convention; Lightning calls it through
``loader.sampler``) makes the next epoch ``e``: when the workers are ready for another one, they
rebuild their sources at ``e``'s start (a seek) before it starts.

Lifetime: the loader owns its epochs' state (:mod:`loader._epochs`) and nothing it holds refers
back to it, so dropping the last reference closes it at once (its finalizer), iterated or not.

This module is a facade: configuration, epochs and the public API. Workers are driven by the
coordinator (:mod:`loader._coordinator`); the state arithmetic is :mod:`loader._checkpoint`'s.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ipc.wire import Position, Sampling
from workers import Shard

from . import _autotune, _checkpoint, _distributed, _ranks, _trace, _tuning
from ._autotune import Autotuner, AutotuneReport
from ._checkpoint import Resume
from ._config import LoaderConfig
from ._coordinator import Coordinator
from ._diagnose import Diagnosis, diagnose
from ._epochs import Epoch, EpochIterator, EpochSampler
from ._errors import LoaderClosedError
from ._healing import Healing, Timeouts, check_healable
from ._pool import WorkerPool
from ._session import Delivery
from ._stats import LoaderStats, Timeline, TrainerCounters, WorkerStats
from ._validate import check_not_importing_main
from ._views import build_batch, current_stream, register_pytree_nodes

logger = logging.getLogger("loader")

__all__ = ["AutotuneReport", "Diagnosis", "Loader", "LoaderStats", "WorkerStats"]

#: Every Loader whose workers were started and that was not closed (weakly: a dropped loader
#: leaves it). The ``leak_check`` fixture reads it to find loaders left open by a test.
OPEN_LOADERS: weakref.WeakSet[Loader] = weakref.WeakSet()


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
        num_workers: int | str = 2,
        feeders: Callable[[Shard], Mapping[str, Any]] | None = None,
        device: str = "cpu",
        device_id: int | None = None,
        num_threads: int | str | None = None,
        prefetch: int = 2,
        output: str = "numpy",
        copy: bool = False,
        capture: bool = True,
        seed: int = 0,
        timeout: float | None = None,
        start_method: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        startup_timeout: float = 300.0,
        shm_limit: int | None = None,
        max_restarts: int = 0,
        on_error: str = "raise",
        max_skipped: int | None = None,
        in_order: bool = True,
        trace: str | os.PathLike[str] | None = None,
        memory_limit: int | float | None = None,
    ) -> None:
        arguments = {k: v for k, v in locals().items() if k not in ("self", "source", "step")}
        self._closed = True  # until the pool is up; close() must work on a half-built loader
        self._coordinator: Coordinator | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None
        check_not_importing_main()
        config = LoaderConfig.build(source, step, **arguments)
        self._autotuner = _make_autotuner(config)
        if self._autotuner is not None:
            config = config.with_layout(self._autotuner.layout)
        self._next_layout: _autotune.Layout | None = None  # decided, applied between epochs
        self._epoch = 0  # the epoch the next iter() runs
        self._current: Epoch | None = None  # the newest epoch (shared with its iterator)
        self._sampler = EpochSampler(self)  # (it refers to this loader weakly)
        self._kind: str | None = None
        self._checks = _ranks.RankChecks()
        self._counters = TrainerCounters(created=time.monotonic())
        #: every batch's stage times and the trainer's next() calls (stats, diagnose, trace)
        self._timeline = Timeline(config.num_workers)
        #: a loaded state, until its epoch starts (then the epoch's own: ``Epoch.resume``)
        self._resume: Resume | None = None
        self._resume_steps: list[int] = []  # batches each worker has left in that epoch
        self._launch(config)
        if self._autotuner is not None:
            self._fit_memory(self._autotuner)

    def _launch(self, config: LoaderConfig, *, relaunch: bool = False) -> None:
        """Start ``config``'s workers and wait until each is ready (raises, closed, if not).
        ``relaunch``: a new layout of an open loader at an epoch boundary (num_workers="auto")."""
        self.config = config
        if config.output == "torch":
            register_pytree_nodes()
        timeouts = Timeouts(
            timeout=config.timeout,
            trace=None if config.timeout is None else config.startup_timeout,
            startup=config.startup_timeout,
        )
        healing = Healing(
            max_restarts=config.max_restarts,
            on_error=config.on_error,
            max_skipped=config.max_skipped,
            timeouts=timeouts,
        )
        coordinator = Coordinator(
            WorkerPool(config.worker_specs(), config.start_method),
            healing,
            in_order=config.in_order,
            stream_of=current_stream(config.output) if config.device == "gpu" else None,
            timeline=self._timeline,
        )
        self._coordinator = coordinator
        self._finalizer = weakref.finalize(self, coordinator.close)
        self._closed = False
        OPEN_LOADERS.add(self)
        try:
            coordinator.start(config.startup_timeout)
        except BaseException:
            self.close()
            raise
        if relaunch:
            return
        self._counters.ready_at = time.monotonic()
        self._counters.startup_wait_ns = coordinator.wait_ns
        if config.on_error == "skip" or config.max_restarts:
            self._check_healable()
        if _distributed.group_size() > 1 and not self._checks.deferred:
            self._check_configuration()  # a collective: only where every rank builds one
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
        launcher set one up re-lays its workers for the group's rank before its first epoch.
        Costs nothing once settled."""
        coordinator = self._require_open()
        config = self.config
        started = (self._current is not None and self._current.started) or bool(self._resume)
        try:
            settled, relay = _ranks.settle(config, started=started)
        except (ValueError, RuntimeError):
            self.close()
            raise
        self.config = settled
        if not relay:
            return coordinator
        logger.info(
            "rank %d of %d from the process group (the loader was built as rank %d of %d): "
            "restarting its workers for that shard",
            settled.rank,
            settled.world_size,
            config.rank,
            config.world_size,
        )
        if self._finalizer is not None:
            self._finalizer()
        # no collective in here: other ranks may be settling without a re-lay
        self._checks.deferred = True
        self._launch(settled)
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

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter(loader)`` run ``epoch``: its order, and ``batch.info.epoch``
        (the convention of torch's ``DistributedSampler``, which Lightning follows at every
        epoch's start through ``loader.sampler``). The epoch the next ``iter()`` runs anyway
        costs nothing; another moves the workers to ``epoch``'s start when that epoch starts
        (they rebuild their sources for it). An epoch half-delivered now goes on until the next
        ``iter()``, which ends it early as always. A state loaded with :meth:`load_state_dict`
        is kept for its own epoch, and dropped (with a logged warning) for another."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"set_epoch() takes an epoch number (an int >= 0), got {epoch!r}")
        self._require_open()
        if epoch == self._epoch:
            return
        resume = self._resume
        if resume is not None:
            logger.warning(
                "set_epoch(%d): the state loaded for epoch %d is dropped, epoch %d runs from its "
                "start (call set_epoch(%d), or nothing, to resume that state)",
                epoch,
                resume.epoch,
                epoch,
                resume.epoch,
            )
            self._resume, self._resume_steps = None, []
        self._epoch = epoch

    @property
    def sampler(self) -> EpochSampler:
        """What a trainer calls ``set_epoch`` on at each epoch's start (Lightning does):
        ``loader.sampler.set_epoch(e)`` is :meth:`set_epoch`. Not a torch ``Sampler``, so
        Lightning does not take the loader for a ``DataLoader`` to re-make."""
        return self._sampler

    @property
    def batch_sampler(self) -> EpochSampler:
        """The same object as :attr:`sampler` (with ``batch_size``), for code that looks for a
        sampler through a ``DataLoader``'s ``batch_sampler``."""
        return self._sampler

    def __iter__(self) -> Iterator[Any]:
        """An iterator over the next epoch. Lazy: the epoch starts at its first ``next()``, so
        an iterator thrown away (Lightning makes one to check the loader) changes nothing.
        Starting another while an epoch is half-delivered ends that epoch early everywhere."""
        self._require_open()
        current = self._current
        if current is not None:
            current.leave_accelerate()
            if current.in_progress:
                self._abort(current)
            elif not current.started:
                current.replaced = True
        run = Epoch(self._epoch)
        self._current = run
        return EpochIterator(self, run)

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
        self._apply_layout()
        loaded = self._loaded()
        if loaded is not None:
            resume, left = loaded
            return resume.epoch_length(self._epoch_length(), left)
        return self._epoch_length()

    def remaining(self) -> int:
        """Batches still to come in the epoch in progress (between epochs: in the next one,
        which is shorter than ``len()`` after :meth:`load_state_dict`)."""
        self._settle()
        self._apply_layout()
        current = self._current
        if current is not None and current.in_progress:
            if current.expected is None:
                self._epoch_length()  # raises: unknown for this source
            assert current.expected is not None
            return current.expected - current.delivered
        if self._resume is not None:
            return sum(self._resume_steps)
        return self._epoch_length()

    def state_dict(self) -> dict[str, Any]:
        """Where the loader stands: a small JSON-serialisable dict (O(shards)) to save with a
        checkpoint and give to :meth:`load_state_dict`.

        It counts, per global shard, the batches the trainer has received (handed out by the
        iterator; prefetched ones do not count) in the epoch in progress, and keeps the DALI
        random generator states of each shard's first batch not received, so that a resume on
        the same layout gives the same bytes; once an epoch's last batch was handed out, it
        describes the next epoch with nothing received (whether or not ``next()`` was called
        again). With a ``torch.distributed`` group up it is a collective:
        every rank calls it and gets the same global dict; without one it describes this rank's
        shards. Costs no message to the workers. Needs :func:`sharded_source` or
        :func:`sharded_files`.
        """
        coordinator = self._settle()
        sampling = self._sampling()
        config = self.config
        epoch = self._active_epoch()
        loaded = self._loaded()
        # (without a loaded state: nothing received before this run)
        resume = Resume(Position(epoch, ())) if loaded is None else loaded[0]
        current = self._current
        in_progress = current is not None and current.in_progress
        delivered = coordinator.delivered() if in_progress else [0] * config.num_workers
        mine, history, steps = resume.progress([s.index for s in config.shards], delivered)
        if in_progress or coordinator.next_epoch() == epoch:
            states = coordinator.random_states()
        else:  # set_epoch: the workers move to that epoch's start, seeded for it
            states = [b""] * config.num_workers
        random = [_checkpoint.random_json(s) for s in states]
        gathered = _distributed.gather(
            {
                "rank": config.rank,
                "received": mine,
                "epoch": epoch,
                "steps": steps,
                "random": random,
            }
        )
        return _checkpoint.make_state(
            sampling=sampling,
            epoch=epoch,
            world_size=config.world_size,
            num_workers=config.num_workers,
            received=_checkpoint.merge_ranks(
                mine, config.rank, config.num_workers, config.world_size, gathered
            ),
            history=history,
            steps=_checkpoint.rank_steps(steps, config.rank, config.world_size, gathered),
            random=_checkpoint.merge_ranks(
                random, config.rank, config.num_workers, config.world_size, gathered, "random"
            ),
        )

    def load_state_dict(self, state: Mapping[str, Any], *, strict: bool = True) -> None:
        """Continue from a state of :meth:`state_dict`, on this or another layout.

        Call it before the next ``iter(loader)``: that epoch continues at the first batch not
        yet received (no batch before it is read), and later epochs run as if there had been no
        interruption. On the same world size and workers the batches are byte-identical to the
        uninterrupted run's, DALI's random draws included (the workers restore their random
        generators; see the docs for which pipelines); on another layout the samples not yet
        received are split evenly among the new shards (padding flagged), every rank the same
        number of steps, and the random draws start afresh (logged). A state that cannot apply
        (another dataset size or fingerprint, seed or batch size, a newer format) raises
        ``ValueError`` naming the field, before any worker does anything; ``strict=False``
        resumes over a dataset whose fingerprint differs with a warning instead.
        """
        self._settle()
        if self._autotuner is not None:
            self._resume_layout(state)
        coordinator = self._apply_layout()
        config = self.config
        resume = _checkpoint.parse_state(
            state,
            sampling=self._sampling(),
            world_size=config.world_size,
            num_workers=config.num_workers,
            rank=config.rank,
            strict=strict,
        )
        current = self._current
        if current is not None and current.in_progress:
            self._abort(current)
            self._current = None
        shards = [shard.index for shard in config.shards]
        steps = coordinator.seek(resume.position, resume.random_states(shards))
        self._resume, self._resume_steps = resume, steps
        self._epoch = resume.epoch
        self._collective(lambda: _ranks.RankChecks.resumed(sum(steps)))
        logger.info(
            "resuming epoch %d at %s (%s layout): %d batches received before, %d left on this rank",
            resume.epoch,
            list(resume.position.segments[-1][1]),
            "same" if resume.continues else "new",
            resume.before,
            sum(steps),
        )
        if not resume.continues:
            logger.info(
                "random draws restart on a new layout: the samples of epoch %d go on exactly, "
                "DALI's random draws (augmentations) differ from an uninterrupted run's; draw "
                "them from the sample id in load() where they must not",
                resume.epoch,
            )
        elif resume.random is None:
            logger.info(
                "the state has no random generator states (saved before they were kept): the "
                "samples go on exactly, DALI's random draws differ from an uninterrupted run's"
            )

    def close(self) -> None:
        """Stop every worker and release all shared memory (first, with ``trace=``, write the
        trace). Idempotent; bounded in time."""
        if not self._closed and self.config.trace is not None and self._coordinator is not None:
            try:
                self.save_trace(self.config.trace)
            except OSError as error:
                warnings.warn(f"the trace was not written: {error}", RuntimeWarning, stacklevel=2)
        self._closed = True
        OPEN_LOADERS.discard(self)
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
        return self._require_open().pids()

    def stats(self, window: float = 10.0) -> LoaderStats:
        """A snapshot of per-worker and trainer-side counters: totals since the start, and the
        stage times of the last ``window`` seconds up to the latest ``next()`` (``recent``,
        ``recent_trainer``, over ``window_seconds``)."""
        coordinator = self._coordinator
        assert coordinator is not None
        if isinstance(window, bool) or not isinstance(window, (int, float)) or not window > 0:
            raise ValueError(f"window must be a positive number of seconds, got {window!r}")
        current = self._current
        if current is not None and current.finished and not self.closed:
            # an epoch over by count: its end (with the workers' counters) is on its way
            coordinator.finish_epoch()
        stats = coordinator.stats(self._counters, float(window), self.config.cpus)
        tuner = self._autotuner
        return stats if tuner is None else dataclasses.replace(stats, autotune=tuner.report())

    def diagnose(self, window: float = 30.0) -> Diagnosis:
        """Is the input pipeline the bottleneck? Over the last ``window`` seconds of iteration
        (the traced first batch left out): the fraction of the training loop's time spent
        waiting for data, the stage that dominates in the workers, whether they are
        CPU-saturated, waiting on I/O or blocked on full slots, and one suggestion with the
        figure it rests on. ``print(loader.diagnose())`` shows it. Costs no message to the
        workers. The settings every rank shares (``num_workers``...) are advised within the
        host's CPUs split among its local ranks, from every rank's figures: with a
        ``torch.distributed`` group up this is a collective, call it on every rank (see
        docs/diagnosis.md)."""
        config = self.config
        stats = self.stats(window)
        sampling = self._coordinator.sampling() if self._coordinator is not None else None
        return diagnose(
            stats,
            num_threads=config.num_threads,
            prefetch=config.prefetch,
            in_order=config.in_order,
            config=config,
            fingerprint=None if sampling is None else sampling.fingerprint,
        )

    def save_trace(self, path: str | os.PathLike[str], seconds: float = 60.0) -> Path:
        """Write the last ``seconds`` of per-worker and trainer spans to ``path`` as Chrome
        trace-event JSON (open it in Perfetto or ``chrome://tracing``); returns the path. At
        most the last 8,192 batches of each worker are kept (see docs/diagnosis.md). With more
        than one rank each writes its own file: ``{rank}`` in the file name is the rank, else
        ``.rank<k>`` goes before the extension (``trace.json`` -> ``trace.rank1.json``)."""
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
            raise ValueError(f"seconds must be a positive number, got {seconds!r}")
        coordinator = self._coordinator
        if coordinator is None:
            raise LoaderClosedError("the loader never started: there is nothing to trace")
        names = [
            f"worker {s.index} (shard {s.shard.index}/{s.shard.count}, pid {s.handle.pid})"
            for s in coordinator.sessions
        ]
        config = self.config
        trace = _trace.trace_events(
            self._timeline,
            float(seconds),
            names,
            pid=os.getpid(),
            name=f"dali-capture-loader, rank {config.rank} of {config.world_size}",
        )
        target = _trace.rank_path(path, config.rank, config.world_size)
        return _trace.write_trace(target, trace)

    # ------------------------------------------------------------------------------ epochs
    def _start(self, run: Epoch) -> Coordinator:
        """The first ``next()`` of ``run``: settle the rank, start the epoch in every worker."""
        self._settle()
        coordinator = self._apply_layout()
        if not self._checks.configuration_checked and _distributed.group_size() > 1:
            self._check_configuration()
        run.epoch = epoch = self._epoch
        resume, left = self._resume, self._resume_steps
        self._resume, self._resume_steps = None, []  # the epoch's own from now on
        if resume is not None and resume.epoch == epoch:  # (set_epoch drops another one)
            shards = [shard.index for shard in self.config.shards]
            base, cursor = resume.first_turn(shards, left)
            run.resume, run.expected, run.first_step = resume, sum(left), resume.before
            coordinator.start_epoch(epoch, base, cursor)
        else:
            ready = coordinator.next_epoch()
            if ready != epoch:  # set_epoch: another epoch than the workers are ready for
                coordinator.seek(Position(epoch, ()))
                logger.info(
                    "epoch %d starts as the trainer set it (set_epoch): the workers rebuilt "
                    "their sources for it (they were ready for epoch %s)",
                    epoch,
                    ready,
                )
            run.expected = coordinator.steps_per_epoch()
            coordinator.start_epoch(epoch)
        run.started = True
        self._epoch += 1
        if self._counters.iterating_since is None:
            self._counters.iterating_since = time.monotonic()
        run.join_accelerate()
        return coordinator

    def _epoch_over(self, run: Epoch) -> None:
        """``run`` handed out its last batch: with num_workers="auto", measure it and decide
        the next epoch's layout (a collective under torch.distributed: every rank ends an
        epoch at the same step). The new workers start at the next ``len()``/``iter()`` step,
        before any worker hears of that epoch."""
        tuner = self._autotuner
        if tuner is None or run.replaced:
            return
        if tuner.settled and run.epoch % _autotune.SETTLED_EVERY:
            return  # settled: the memory is checked every few epochs (the same on every rank)
        config = self.config
        was_settled = tuner.settled
        decision = _tuning.after_epoch(
            tuner, self._timeline, self._require_open().sessions, config, run.epoch
        )
        if decision is None:
            return
        if decision.changed:
            logger.info(
                "num_workers='auto': epoch %d runs %s (was %s): %s",
                run.epoch + 1,
                decision.layout,
                config.layout,
                decision.reason,
            )
            self._next_layout = decision.layout
        elif decision.settled and not was_settled:
            logger.info("num_workers='auto': %s", decision.reason)

    def _resume_layout(self, state: Mapping[str, Any]) -> None:
        """num_workers="auto": a state saved on this world size resumes on its own number of
        workers (the same bytes, random draws included), and the search goes on from there."""
        layout = state.get("layout") if isinstance(state, Mapping) else None
        if not isinstance(layout, Mapping) or layout.get("world_size") != self.config.world_size:
            return
        workers = layout.get("num_workers")
        tuner = self._autotuner
        if tuner is None or tuner.workers is not None or not isinstance(workers, int):
            return
        current = self._current
        if workers < 1 or workers == self.config.num_workers:
            return
        if current is not None and current.in_progress:
            return
        target = tuner.resume_on(workers)
        if target is not None:
            self._next_layout = target

    def _apply_layout(self) -> Coordinator:
        """Between epochs, the layout num_workers="auto" decided (a new pool), if any."""
        coordinator = self._require_open()
        current = self._current
        if self._next_layout is None or (current is not None and current.in_progress):
            return coordinator
        layout, self._next_layout = self._next_layout, None
        return self._relaunch(coordinator, layout)

    def _fit_memory(self, tuner: Autotuner) -> None:
        """Before the first epoch: fewer workers when those started are over the memory
        budget of num_workers="auto" (a collective under torch.distributed)."""
        decision = _tuning.at_start(tuner, self._require_open().sessions, self.config)
        if decision.changed:
            self._relaunch(self._require_open(), decision.layout)
        logger.info(
            "num_workers='auto' (tuning %s): starting with %s, %s; budgets: %d CPUs, %.0f MiB",
            tuner.tuning,
            decision.layout,
            decision.reason,
            tuner.cpus,
            tuner.memory_limit / 2**20,
        )

    def _relaunch(self, coordinator: Coordinator, layout: _autotune.Layout) -> Coordinator:
        """Close this pool (its processes and shared memory) and start one of ``layout``
        between two epochs; the next epoch's shards follow the new layout."""
        waited = coordinator.wait_ns - self._counters.startup_wait_ns
        if self.config.device == "gpu" and any(s.reader.held for s in coordinator.sessions):
            warnings.warn(
                f"num_workers='auto' starts {layout} while batches of the old workers are "
                "still held: their GPU memory goes with those workers, so they must not be "
                "used any more (drop batches before the next epoch starts, or pass copy=True)",
                RuntimeWarning,
                stacklevel=4,
            )
        if self._finalizer is not None:
            self._finalizer()
        self._launch(self.config.with_layout(layout, self._epoch), relaunch=True)
        fresh = self._require_open()
        self._counters.startup_wait_ns = fresh.wait_ns - waited
        return fresh

    def _next(self, run: Epoch) -> Any:
        entered = time.perf_counter_ns()
        coordinator = first = self._require_open()
        polled = coordinator.wait_ns
        if run.replaced:
            raise RuntimeError(
                f"this iterator of epoch {run.epoch} was replaced by a newer iter(loader) or "
                "load_state_dict(); iterate one epoch at a time"
            )
        if not run.started:
            coordinator = self._start(run)
            if coordinator is not first:  # relaunched: the old pool's waits, then the new one's
                polled -= first.wait_ns
        delivery = None
        if not run.finished and (run.expected is None or run.delivered < run.expected):
            coordinator.wait_signatures()
            if not self._checks.traced_checked:
                reference = coordinator.reference
                fields = None if reference is None else dict(reference.agreement_fields())
                self._collective(lambda: self._checks.traced(fields))
            delivery = coordinator.next_batch(run.next_step)
        if delivery is None:  # over (or nothing left: a state saved at its epoch's end)
            over = not run.finished
            if over:
                run.finished = True
                self._counters.last_batch_at = time.monotonic()
            run.leave_accelerate()
            waited = self._require_open().wait_ns - polled
            self._timeline.next_call(entered, waited, run.epoch, -1, -1)
            if over:
                self._epoch_over(run)
            raise StopIteration
        run.handed_out()
        info = delivery.info
        batch = self._hand_out(coordinator, delivery)
        waited = coordinator.wait_ns - polled
        self._timeline.next_call(entered, waited, info.epoch, info.worker_step, info.worker)
        if run.finished:
            self._epoch_over(run)
        return batch

    def _hand_out(self, coordinator: Coordinator, delivery: Delivery) -> Any:
        """The user's batch over a delivered slot (views, or private copies)."""
        if self._kind is None:
            self._kind = coordinator.output_kind(delivery.info.worker)
        config = self.config
        descriptor = delivery.descriptor
        batch = build_batch(
            delivery.arrays,
            delivery.lease,
            descriptor,
            self._kind,
            delivery.info,
            output=config.output,
            copy=config.copy,
            releases=coordinator.releases.queue,
            owner=delivery.reader,
        )
        worker, reader = delivery.info.worker, delivery.reader
        del delivery  # (its views: with copy=True the batch holds private copies)
        if config.copy:
            coordinator.release_at_once(worker, reader, descriptor)
        real = config.batch_size - descriptor.padded
        # a row filled in for a skipped sample (on_error="skip") is a repeat, like padding
        real -= sum(1 for row in descriptor.replaced if row < real)
        self._counters.handed_out(time.monotonic(), real)
        return batch

    def _abort(self, run: Epoch) -> None:
        """Stop ``run`` in every worker and wait until each has rebuilt its sources."""
        coordinator = self._require_open()
        run.finished = True
        run.replaced = True
        coordinator.abort_epoch(run.epoch)
        logger.info("epoch %d was left early; workers rebuilt their sources", run.epoch)

    def _loaded(self) -> tuple[Resume, int] | None:
        """The loaded state of the epoch in progress (between epochs: of the next one), and
        the batches this rank had left at its start; None for an epoch run from its start."""
        current = self._current
        if current is not None and current.in_progress:
            resume = current.resume
            return None if resume is None else (resume, current.expected or 0)
        if self._resume is not None:
            return self._resume, sum(self._resume_steps)
        return None

    def _active_epoch(self) -> int:
        """The epoch in progress, or between epochs the next one."""
        current = self._current
        return current.epoch if current is not None and current.in_progress else self._epoch

    def _epoch_length(self) -> int:
        """Batches of a whole epoch on this rank; ``TypeError`` when the source cannot say."""
        steps = self._require_open().steps_per_epoch()
        if steps is None:
            raise TypeError(
                "len(loader) is unknown for this source: use sharded_source(), or a reader built "
                "with stick_to_shard=True and pad_last_batch=True (every sample once per epoch, "
                "padded rows flagged in batch.info.padded)"
            )
        return steps

    def _sampling(self) -> Sampling:
        sampling = self._require_open().sampling()
        if sampling is None:
            raise TypeError(_checkpoint.NOT_RESUMABLE)
        return sampling

    # ------------------------------------------------------------------------------ checks
    def _check_healable(self) -> None:
        try:
            check_healable(self.config, self._require_open().sampling() is not None)
        except ValueError:
            self.close()
            raise

    def _check_configuration(self) -> None:
        steps = self._require_open().steps_per_epoch()
        self._collective(lambda: self._checks.configuration(self.config, steps))

    def _collective(self, check: Callable[[], None]) -> None:
        """Run a cross-rank check; a disagreement closes the loader before it leaves."""
        try:
            check()
        except BaseException as error:
            coordinator = self._coordinator
            if coordinator is not None:
                coordinator.fail(error)
            self.close()
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


def _make_autotuner(config: LoaderConfig) -> Autotuner | None:
    """The layout search of num_workers="auto" / num_threads="auto" (None without either). With
    a process group up every rank starts from the same guess: the smallest budgets of all."""
    if not (config.workers_auto or config.threads_auto):
        return None
    cpus, memory_limit = config.cpus, config.memory_limit or 0
    gathered = _distributed.gather({"cpus": cpus, "memory_limit": memory_limit})
    if gathered is not None:
        cpus = min(int(g["cpus"]) for g in gathered)
        memory_limit = min(int(g["memory_limit"]) for g in gathered)
    follows = config.workers_auto and not config.num_threads_given
    return Autotuner(
        cpus=cpus,
        memory_limit=memory_limit,
        workers=None if config.workers_auto else config.num_workers,
        threads=None if config.threads_auto or follows else config.num_threads,
    )
