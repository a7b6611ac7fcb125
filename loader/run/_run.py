"""The run: what changes per epoch and per layout, between the ``Loader`` (the user's facade) and
the ``Coordinator`` (the event loop over one pool of workers). Runs in the trainer.

::

    Loader ──owns──► Run ──owns──► Coordinator ──owns──► WorkerPool ──► worker processes
      │ (facade)      │  (layout,     (event loop,         (processes, sockets, arenas)
      │               │   epochs,      sessions,
      │               │   Progress)    a Snapshot for the rest)
      └── EpochIterator ──► Epoch ◄── Run (the newest epoch; the iterator shares it)

Who may act:

* **Only the start of an epoch (the first ``next()`` of an ``iter()``) and ``close()`` start, stop
  or replace worker processes**: a layout of ``num_workers="auto"``, the rank a process group
  settles after the loader was built, a loaded state's seek. The constructor starts the first
  pool. Healing (a dead worker replaced) is the coordinator's, inside a ``next()``.
* ``len()``, ``remaining()``, ``state_dict()``, ``load_state_dict()``, ``set_epoch()``,
  ``stats()`` are queries or store what the next epoch's start applies: they compute from the
  configuration (as it will be: :meth:`Run.planned`), the sampling the workers reported and the
  :class:`Progress`, and never wait on a worker.

Progress: the epoch in progress (between epochs, the next one), the loaded state it went on
from, and per worker the batches handed out and the random generator states of the first batch
not handed out. ``state_dict()`` is its encoding (:func:`loader.run._checkpoint.make_state`, after
the cross-rank gather); ``load_state_dict()`` stores one (a :class:`Resume`) for the next epoch's
start, as torchdata's loaders restore at the next ``iter()``.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ipc.wire import Position, RandomStates, Sampling
from workers import steps_left, steps_per_epoch

from .._errors import LoaderClosedError
from ..config import _autotune, _distributed
from ..config._autotune import Autotuner
from ..config._config import LoaderConfig
from ..engine._coordinator import Coordinator
from ..engine._healing import Healing, Timeouts, check_healable
from ..engine._session import Delivery
from ..engine._stats import Timeline, TrainerCounters
from ..engine._views import build_batch, current_stream, register_pytree_nodes
from ..processes._pool import WorkerPool
from . import _checkpoint, _ranks, _tuning
from ._checkpoint import Resume
from ._epochs import Epoch

logger = logging.getLogger("loader")


@dataclass(frozen=True)
class Progress:
    """Where the run stands, as ``state_dict()`` encodes it: ``epoch`` (in progress, or between
    epochs the next one), the loaded state it goes on from (``resume``; its received counts
    and earlier layouts), and per worker of this rank the batches handed out since then and the
    random generator states of its first batch not handed out."""

    epoch: int
    resume: Resume | None
    delivered: tuple[int, ...]
    random: tuple[RandomStates, ...]


class Run:
    """One loader's workers over its lifetime: the current layout's pool and coordinator, the
    epochs, the pending layout and the pending state. See the module docstring for who may
    start or stop processes."""

    def __init__(
        self,
        config: LoaderConfig,
        *,
        autotuner: Autotuner | None,
        timeline: Timeline,
        counters: TrainerCounters,
    ) -> None:
        self.config = config
        self.autotuner = autotuner
        self.timeline = timeline
        self.counters = counters
        self.coordinator: Coordinator | None = None
        self._closed = True  # until a pool is up: close() works on a half-built run
        self.epoch = 0  # the epoch the next iter() runs
        self.current: Epoch | None = None  # the newest epoch (shared with its iterator)
        self.pending: Resume | None = None  # a loaded state, applied at its epoch's start
        self.pending_for: tuple[int, int] | None = None  # the (rank, world size) it was for
        self.next_layout: _autotune.Layout | None = None  # decided, applied at the next start
        self.checks = _ranks.RankChecks()
        self._kind: str | None = None

    # ------------------------------------------------------------------------------ pools
    def launch(self, config: LoaderConfig, *, relaunch: bool = False) -> None:
        """Start ``config``'s workers and wait until each is ready (closes and raises if not).
        ``relaunch``: a new pool of an open run at an epoch's start."""
        self.config = config
        if config.output == "torch":
            register_pytree_nodes()
        coordinator = Coordinator(
            WorkerPool(config.worker_specs(), config.start_method),
            _healing(config),
            in_order=config.in_order,
            stream_of=current_stream(config.output) if config.device == "gpu" else None,
            timeline=self.timeline,
        )
        self.coordinator, self._closed = coordinator, False
        try:
            coordinator.start(config.startup_timeout)
        except BaseException:
            self.close()
            raise
        if relaunch:
            return
        self.counters.ready_at = time.monotonic()
        self.counters.startup_wait_ns = coordinator.wait_ns
        if config.on_error == "skip" or config.max_restarts:
            self._check_healable()
        if _distributed.group_size() > 1 and not self.checks.deferred:
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

    def fit_memory(self) -> None:
        """At construction: fewer workers when those started are over the memory budget of
        num_workers="auto" (a collective under torch.distributed)."""
        tuner = self.autotuner
        assert tuner is not None
        decision = _tuning.at_start(tuner, self.require().worker_facts(), self.config)
        if decision.changed:
            self._relaunch(decision.layout)
        logger.info(
            "num_workers='auto' (tuning %s): starting with %s, %s; budgets: %d CPUs, %.0f MiB",
            tuner.tuning,
            decision.layout,
            decision.reason,
            tuner.cpus,
            tuner.memory_limit / 2**20,
        )

    @property
    def closed(self) -> bool:
        """Closed, or shut down after a failure (its pool is closed)."""
        coordinator = self.coordinator
        return self._closed or coordinator is None or coordinator.pool.closed

    def close(self) -> None:
        """Stop the pool's workers and release its shared memory (idempotent, bounded)."""
        self._closed = True
        if self.coordinator is not None:
            self.coordinator.close()

    def require(self) -> Coordinator:
        """The open coordinator (``LoaderClosedError`` after ``close()`` or a failure)."""
        coordinator = self.coordinator
        if coordinator is not None and coordinator.failure is not None:
            raise LoaderClosedError(
                f"the loader was shut down after a failure: {coordinator.failure}"
            ) from coordinator.failure
        if self.closed or coordinator is None:
            raise LoaderClosedError("the loader is closed")
        return coordinator

    def planned(self, *, strict: bool = True) -> LoaderConfig:
        """The configuration the next epoch starts with: the rank a process group settled and
        the layout num_workers="auto" decided (pure: nothing starts here). ``strict=False``:
        the running configuration where the rank cannot be settled yet (nothing closes)."""
        if self._live():
            return self.config
        if not strict:
            try:
                config, _relay = _ranks.settle(self.config, started=False)
            except (ValueError, RuntimeError):
                return self.config
        else:
            config, _relay = self._settle()
        if self.next_layout is not None:
            config = config.with_layout(self.next_layout, self.epoch)
        return config

    def _settle(self) -> tuple[LoaderConfig, bool]:
        """The configuration at its final rank and world size, and whether the workers must be
        re-laid for it (closes and raises when that contradicts what already ran or a state
        loaded for another rank)."""
        current = self.current
        try:
            settled, relay = _ranks.settle(
                self.config, started=current is not None and current.started
            )
            placed = (settled.rank, settled.world_size)
            if self.pending is not None and relay and self.pending_for != placed:
                raise RuntimeError(
                    f"a state was loaded while this loader was rank {self.config.rank} of "
                    f"{self.config.world_size}, but the torch.distributed group makes it rank "
                    f"{settled.rank} of {settled.world_size}: load the state after the process "
                    "group is set up (e.g. in the trainer's own restore hook)"
                )
        except (ValueError, RuntimeError):
            self.close()
            raise
        return settled, relay

    def _prepare(self) -> Coordinator:
        """At an epoch's start: the settled rank and the decided layout, each a new pool when it
        differs from the running one (the only place, with close(), that replaces workers)."""
        coordinator = self.require()
        config = self.config
        settled, relay = self._settle()
        self.config = settled
        if relay:
            logger.info(
                "rank %d of %d from the process group (the loader was built as rank %d of "
                "%d): restarting its workers for that shard",
                settled.rank,
                settled.world_size,
                config.rank,
                config.world_size,
            )
            coordinator.close()
            self.checks.deferred = True  # no collective here: other ranks may not re-lay
            self.launch(settled)
            coordinator = self.require()
        if self.next_layout is not None:
            layout, self.next_layout = self.next_layout, None
            coordinator = self._relaunch(layout)
        return coordinator

    def _relaunch(self, layout: _autotune.Layout) -> Coordinator:
        """Close this pool (its processes and shared memory) and start one of ``layout``; the
        next epoch's shards follow it."""
        coordinator = self.require()
        waited = coordinator.wait_ns - self.counters.startup_wait_ns
        if self.config.device == "gpu" and coordinator.batches_held():
            warnings.warn(
                f"num_workers='auto' starts {layout} while batches of the old workers are "
                "still held: their GPU memory goes with those workers, so they must not be "
                "used any more (drop batches before the next epoch starts, or pass copy=True)",
                RuntimeWarning,
                stacklevel=5,
            )
        coordinator.close()
        self.launch(self.config.with_layout(layout, self.epoch), relaunch=True)
        fresh = self.require()
        self.counters.startup_wait_ns = fresh.wait_ns - waited
        return fresh

    # ------------------------------------------------------------------------------ epochs
    def open_epoch(self) -> Epoch:
        """``iter(loader)``: a new epoch (lazy: it starts at its first ``next()``); one still
        half-delivered is stopped everywhere first."""
        self.require()
        current = self.current
        if current is not None:
            current.leave_accelerate()
            if current.in_progress:
                self._abort(current)
            elif not current.started:
                current.replaced = True
        self.current = Epoch(self.epoch)
        return self.current

    def set_epoch(self, epoch: int) -> None:
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"set_epoch() takes an epoch number (an int >= 0), got {epoch!r}")
        self.require()
        if epoch == self.epoch:
            return
        resume = self.pending
        if resume is not None:
            logger.warning(
                "set_epoch(%d): the state loaded for epoch %d is dropped, epoch %d runs from its "
                "start (call set_epoch(%d), or nothing, to resume that state)",
                epoch,
                resume.epoch,
                epoch,
                resume.epoch,
            )
            self.pending = None
        self.epoch = epoch

    def next_batch(self, run: Epoch) -> Any:
        """The next batch of ``run`` (``StopIteration`` at its end)."""
        entered = time.perf_counter_ns()
        coordinator = first = self.require()
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
            if not self.checks.traced_checked:
                fields = coordinator.agreement_fields()
                self._collective(lambda: self.checks.traced(fields))
            delivery = coordinator.next_batch(run.next_step)
        if delivery is None:  # over (or nothing left: a state saved at its epoch's end)
            self._over(run, entered, self.require().wait_ns - polled)
            raise StopIteration
        run.handed_out()
        info = delivery.info
        batch = self._hand_out(coordinator, delivery)
        waited = coordinator.wait_ns - polled
        self.timeline.next_call(entered, waited, info.epoch, info.worker_step, info.worker)
        if run.finished:
            self._epoch_over(run)
        return batch

    def _over(self, run: Epoch, entered: int, waited: int) -> None:
        over = not run.finished
        if over:
            run.finished = True
            self.counters.last_batch_at = time.monotonic()
        run.leave_accelerate()
        self.timeline.next_call(entered, waited, run.epoch, -1, -1)
        if over:
            self._epoch_over(run)

    def _start(self, run: Epoch) -> Coordinator:
        """The first ``next()`` of ``run``: the settled rank and decided layout, a loaded state
        or a set epoch applied, the epoch started in every worker."""
        coordinator = self._prepare()
        if not self.checks.configuration_checked and _distributed.group_size() > 1:
            self._check_configuration()
        run.epoch = epoch = self.epoch
        resume, self.pending = self.pending, None  # the epoch's own from now on
        if resume is not None and resume.epoch == epoch:  # (set_epoch drops another one)
            shards = self._shard_indices()
            left = coordinator.seek(resume.position, resume.random_states(shards))
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
        self.epoch += 1
        if self.counters.iterating_since is None:
            self.counters.iterating_since = time.monotonic()
        run.join_accelerate()
        return coordinator

    def _epoch_over(self, run: Epoch) -> None:
        """``run`` handed out its last batch: with num_workers="auto", measure it and decide
        the next epoch's layout (a collective under torch.distributed: every rank ends an
        epoch at the same step); the next epoch's start applies it."""
        tuner = self.autotuner
        if tuner is None or run.replaced:
            return
        if tuner.settled and run.epoch % _autotune.SETTLED_EVERY:
            return  # settled: the memory is checked every few epochs (the same on every rank)
        config, was_settled = self.config, tuner.settled
        decision = _tuning.after_epoch(
            tuner, self.timeline, self.require().worker_facts(), config, run.epoch
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
            self.next_layout = decision.layout
        elif decision.settled and not was_settled:
            logger.info("num_workers='auto': %s", decision.reason)

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
            cut=config.cut_padding,
        )
        worker, reader = delivery.info.worker, delivery.reader
        del delivery  # (its views: with copy=True the batch holds private copies)
        if config.copy:
            coordinator.release_at_once(worker, reader, descriptor)
        real = config.batch_size - descriptor.padded
        # a row filled in for a skipped sample (on_error="skip") is a repeat, like padding
        real -= sum(1 for row in descriptor.replaced if row < real)
        self.counters.handed_out(time.monotonic(), real)
        return batch

    def _abort(self, run: Epoch) -> None:
        """Stop ``run`` in every worker and wait until each has rebuilt its sources."""
        coordinator = self.require()
        run.finished = run.replaced = True
        coordinator.abort_epoch(run.epoch)
        logger.info("epoch %d was left early; workers rebuilt their sources", run.epoch)

    # ------------------------------------------------------------------------------ queries
    def length(self) -> int:
        """``len(loader)``: the epoch's length on this rank (a resumed epoch's: received
        before the save plus what is left)."""
        loaded = self._loaded()
        full = self._epoch_length(self.planned())
        return full if loaded is None else loaded[0].epoch_length(full, loaded[1])

    def remaining(self) -> int:
        """Batches still to come in the epoch in progress (between epochs: in the next one)."""
        current = self.current
        if self._live():
            assert current is not None
            if current.expected is None:
                self._epoch_length(self.config)  # raises: unknown for this source
            assert current.expected is not None
            return current.expected - current.delivered
        loaded = self._loaded()
        return self._epoch_length(self.planned()) if loaded is None else loaded[1]

    def progress(self, config: LoaderConfig | None = None) -> Progress:
        """The run's :class:`Progress` (no message to a worker); ``config``: :meth:`planned`,
        when the caller has it already."""
        config = config or self.planned()
        coordinator = self.require()
        current = self.current
        workers = config.num_workers
        if self._live():
            assert current is not None
            return Progress(
                current.epoch,
                current.resume,
                tuple(coordinator.delivered()),
                tuple(coordinator.random_states()),
            )
        resume = self.pending
        if resume is not None:
            random = tuple(resume.random_states(self._shard_indices(config)))
        elif coordinator.next_epoch() == self.epoch and workers == self.config.num_workers:
            random = tuple(coordinator.random_states())
        else:  # set_epoch, or a new layout: the workers start that epoch seeded for it
            random = (b"",) * workers
        return Progress(self.epoch, resume, (0,) * workers, random)

    def state(self) -> dict[str, Any]:
        """``state_dict()``: :meth:`progress` encoded, gathered across ranks."""
        sampling = self.sampling()
        config = self.planned()
        progress = self.progress(config)
        resume = progress.resume or Resume(Position(progress.epoch, ()))
        mine, history, steps = resume.progress(self._shard_indices(config), progress.delivered)
        random = [_checkpoint.random_json(states) for states in progress.random]
        gathered = _distributed.gather(
            {
                "rank": config.rank,
                "received": mine,
                "epoch": progress.epoch,
                "steps": steps,
                "random": random,
            }
        )
        rank, workers, world = config.rank, config.num_workers, config.world_size
        return _checkpoint.make_state(
            sampling=sampling,
            epoch=progress.epoch,
            world_size=world,
            num_workers=workers,
            received=_checkpoint.merge_ranks(mine, rank, workers, world, gathered),
            history=history,
            steps=_checkpoint.rank_steps(steps, rank, world, gathered),
            random=_checkpoint.merge_ranks(random, rank, workers, world, gathered, "random"),
        )

    def load(self, state: Mapping[str, Any], *, strict: bool) -> None:
        """``load_state_dict()``: check ``state`` and keep it for its epoch's start."""
        self.require()
        if self.autotuner is not None:
            self._resume_layout(state)
        config = self.planned()
        resume = _checkpoint.parse_state(
            state,
            sampling=self.sampling(),
            world_size=config.world_size,
            num_workers=config.num_workers,
            rank=config.rank,
            strict=strict,
        )
        current = self.current
        if current is not None and current.in_progress:
            current.replaced = True  # its iterator is done; the next iter() stops it
        left = self._left(resume, config)
        self.pending, self.epoch = resume, resume.epoch
        self.pending_for = (config.rank, config.world_size)
        self._collective(lambda: _ranks.RankChecks.resumed(left))
        _log_resume(resume, left)

    def sampling(self) -> Sampling:
        sampling = self.require().sampling()
        if sampling is None:
            raise TypeError(_checkpoint.NOT_RESUMABLE)
        return sampling

    def _left(self, resume: Resume, config: LoaderConfig) -> int:
        """Batches this rank has left in ``resume``'s epoch on ``config``'s layout."""
        return sum(
            steps_left(
                self.sampling(),
                resume.epoch,
                self._shard_indices(config),
                config.world_size * config.num_workers,
                resume.position,
                ranks=config.world_size,
            )
        )

    def _loaded(self) -> tuple[Resume, int] | None:
        """The loaded state of the epoch in progress (between epochs: of the next one), and
        the batches this rank had left at its start; None for an epoch run from its start."""
        current = self.current
        if self._live():
            assert current is not None
            resume = current.resume
            return None if resume is None else (resume, current.expected or 0)
        if self.pending is not None:
            return self.pending, self._left(self.pending, self.planned())
        return None

    def _live(self) -> bool:
        """An epoch is being delivered (not replaced by a loaded state)."""
        current = self.current
        return current is not None and current.in_progress and not current.replaced

    def _epoch_length(self, config: LoaderConfig) -> int:
        """Batches of a whole epoch on this rank of ``config``; ``TypeError`` when the source
        cannot say."""
        coordinator = self.require()
        sampling = coordinator.sampling()
        if sampling is not None:
            count = config.world_size * config.num_workers
            return steps_per_epoch(
                sampling.total, count, sampling.batch_size, sampling.drop_last, config.world_size
            )
        steps = coordinator.steps_per_epoch()
        if steps is None:
            raise TypeError(
                "len(loader) is unknown for this source: use sharded_source(), or a reader built "
                "with stick_to_shard=True and pad_last_batch=True (every sample once per epoch, "
                "padded rows flagged in batch.info.padded)"
            )
        return steps

    def _shard_indices(self, config: LoaderConfig | None = None) -> list[int]:
        return [shard.index for shard in (config or self.config).shards]

    def _resume_layout(self, state: Mapping[str, Any]) -> None:
        """num_workers="auto": a state saved on this world size resumes on its own number of
        workers (the same bytes, random draws included), and the search goes on from there."""
        layout = state.get("layout") if isinstance(state, Mapping) else None
        if not isinstance(layout, Mapping) or layout.get("world_size") != self.config.world_size:
            return
        workers, tuner = layout.get("num_workers"), self.autotuner
        if tuner is None or tuner.workers is not None or not isinstance(workers, int):
            return
        if workers < 1 or workers == self.config.num_workers or self._live():
            return
        target = tuner.resume_on(workers)
        if target is not None:
            self.next_layout = target

    # ------------------------------------------------------------------------------ checks
    def _check_healable(self) -> None:
        try:
            check_healable(self.config, self.require().sampling() is not None)
        except ValueError:
            self.close()
            raise

    def _check_configuration(self) -> None:
        steps = self.require().steps_per_epoch()
        self._collective(lambda: self.checks.configuration(self.config, steps))

    def _collective(self, check: Callable[[], None]) -> None:
        """Run a cross-rank check; a disagreement closes the run before it leaves."""
        try:
            check()
        except BaseException as error:
            if self.coordinator is not None:
                self.coordinator.fail(error)
            self.close()
            raise


def _healing(config: LoaderConfig) -> Healing:
    timeouts = Timeouts(
        timeout=config.timeout,
        trace=None if config.timeout is None else config.startup_timeout,
        startup=config.startup_timeout,
    )
    return Healing(
        max_restarts=config.max_restarts,
        on_error=config.on_error,
        max_skipped=config.max_skipped,
        timeouts=timeouts,
    )


def _log_resume(resume: Resume, left: int) -> None:
    logger.info(
        "resuming epoch %d at %s (%s layout): %d batches received before, %d left on this rank",
        resume.epoch,
        list(resume.position.segments[-1][1]),
        "same" if resume.continues else "new",
        resume.before,
        left,
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
