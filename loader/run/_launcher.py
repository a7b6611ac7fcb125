"""The current layout's workers: the pool and coordinator a run is on, started, settled on the
rank a process group gives, replaced by a layout that ``num_workers="auto"`` decided, checked
across ranks, closed. Runs in the trainer.

:class:`Launcher` is the only object that starts or replaces a pool; the :class:`Run` asks it at
an epoch's start (:meth:`Launcher.prepare`) and at construction, and ``close()`` closes it. It
owns the configuration as running (``config``), the coordinator, the layout decided for the
next epoch and the cross-rank checks; the run tells it what it needs of the epochs (the next
epoch, whether one is live, the rank a loaded state was for).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from ipc.wire import Sampling
from workers import steps_per_epoch

from .._errors import LoaderClosedError
from ..config import _autotune, _distributed
from ..config._autotune import Autotuner
from ..config._config import LoaderConfig
from ..engine._coordinator import Coordinator
from ..engine._healing import Healing, Timeouts, check_healable
from ..engine._session import Delivery
from ..engine._stats import LoaderStats, Timeline, TrainerCounters
from ..engine._views import build_batch, current_stream, register_pytree_nodes
from ..processes._pool import WorkerPool
from . import _checkpoint, _ranks, _tuning
from ._epochs import Epoch

logger = logging.getLogger("loader")


class Launcher:
    """The pool and coordinator of the current layout, over the run's lifetime (module
    docstring)."""

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
        self.next_layout: _autotune.Layout | None = None  # decided, applied at the next start
        self.checks = _ranks.RankChecks()
        self._kind: str | None = None  # the output kind of a batch (dict, tuple, one array)

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
        self.counters.ready(time.monotonic(), coordinator.wait_ns)
        if config.on_error == "skip" or config.max_restarts:
            self.check_healable()
        if _distributed.group_size() > 1 and not self.checks.deferred:
            self.check_configuration()  # a collective: only where every rank builds one
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
            self.relaunch(decision.layout)
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

    def require(self, *, interrupted: bool = False) -> Coordinator:
        """The open coordinator (``LoaderClosedError`` after ``close()`` or a failure).
        ``interrupted``: also one an interruption stopped (its sessions still say what was
        handed out: ``state_dict()`` reads them)."""
        coordinator = self.coordinator
        if coordinator is not None and coordinator.failure is not None:
            if coordinator.interrupted and interrupted and not self._closed:
                return coordinator
            if coordinator.interrupted:
                raise LoaderClosedError(
                    f"the loader stopped its workers, {coordinator.failure_reason}; its "
                    "state_dict() still describes the batches handed out: load it into a new "
                    "Loader to go on"
                ) from coordinator.failure
            raise LoaderClosedError(
                f"the loader was shut down after a failure: {coordinator.failure_reason}"
            ) from coordinator.failure
        if self.closed or coordinator is None:
            raise LoaderClosedError("the loader is closed")
        return coordinator

    def planned(self, epoch: int, *, live: bool, strict: bool = True) -> LoaderConfig:
        """The configuration epoch ``epoch`` (the next) starts with: the rank a process group
        settled and the layout num_workers="auto" decided (pure: nothing starts here); the
        running one while an epoch is ``live``. ``strict=False``: the running configuration
        where the rank cannot be settled yet (nothing closes)."""
        if live:
            return self.config
        if not strict:
            try:
                config, _relay = _ranks.settle(self.config, started=False)
            except (ValueError, RuntimeError):
                return self.config
        else:
            config, _relay = self._settle(started=False, loaded_for=None)
        if self.next_layout is not None:
            config = config.with_layout(self.next_layout, epoch)
        return config

    def _settle(
        self, *, started: bool, loaded_for: tuple[int, int] | None
    ) -> tuple[LoaderConfig, bool]:
        """The configuration at its final rank and world size, and whether the workers must be
        re-laid for it (closes and raises when that contradicts what already ``started`` or a
        state loaded for another (rank, world size), ``loaded_for``)."""
        try:
            settled, relay = _ranks.settle(self.config, started=started)
            placed = (settled.rank, settled.world_size)
            if loaded_for is not None and relay and loaded_for != placed:
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

    def prepare(
        self, epoch: int, *, started: bool, loaded_for: tuple[int, int] | None
    ) -> Coordinator:
        """At epoch ``epoch``'s start: the settled rank and the decided layout, each a new pool
        when it differs from the running one (the only place, with close(), that replaces
        workers)."""
        coordinator = self.require()
        config = self.config
        settled, relay = self._settle(started=started, loaded_for=loaded_for)
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
            self.checks.defer()  # no collective here: other ranks may not re-lay
            self.launch(settled)
            coordinator = self.require()
        if self.next_layout is not None:
            layout, self.next_layout = self.next_layout, None
            coordinator = self.relaunch(layout, epoch)
        return coordinator

    def relaunch(self, layout: _autotune.Layout, epoch: int = 0) -> Coordinator:
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
        self.launch(self.config.with_layout(layout, epoch), relaunch=True)
        fresh = self.require()
        self.counters.relaunched(fresh.wait_ns - waited)
        return fresh

    def check_healable(self) -> None:
        try:
            check_healable(self.config, self.require().sampling() is not None)
        except ValueError:
            self.close()
            raise

    def check_configuration(self) -> None:
        steps = self.require().steps_per_epoch()
        self.collective(lambda: self.checks.configuration(self.config, steps))

    def collective(self, check: Callable[[], None]) -> None:
        """Run a cross-rank check; a disagreement closes the run before it leaves."""
        try:
            check()
        except BaseException as error:
            if self.coordinator is not None:
                self.coordinator.fail(error, "the ranks were comparing their loaders")
            self.close()
            raise

    def sampling(self, *, interrupted: bool = False) -> Sampling:
        sampling = self.require(interrupted=interrupted).sampling()
        if sampling is None:
            raise TypeError(_checkpoint.NOT_RESUMABLE)
        return sampling

    def epoch_length(self, config: LoaderConfig) -> int:
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

    def resume_layout(self, state: Mapping[str, Any], *, live: bool) -> None:
        """num_workers="auto": a state saved on this world size resumes on its own number of
        workers (the same bytes, random draws included), and the search goes on from there
        (not while an epoch is ``live``)."""
        layout = state.get("layout") if isinstance(state, Mapping) else None
        if not isinstance(layout, Mapping) or layout.get("world_size") != self.config.world_size:
            return
        workers, tuner = layout.get("num_workers"), self.autotuner
        if tuner is None or tuner.workers is not None or not isinstance(workers, int):
            return
        if workers < 1 or workers == self.config.num_workers or live:
            return
        target = tuner.resume_on(workers)
        if target is not None:
            self.next_layout = target

    # ------------------------------------------------------------------ what it observes
    def stats(self, window: float, *, epoch_over: bool) -> LoaderStats:
        """``stats()``: the coordinator's counters and the trainer's, with the autotuner's
        report (an epoch ``epoch_over`` by count first has its end recorded)."""
        coordinator = self.coordinator
        assert coordinator is not None
        if epoch_over and not self.closed:
            coordinator.finish_epoch()
        stats = coordinator.stats(self.counters, window, self.config.cpus)
        tuner = self.autotuner
        return stats if tuner is None else dataclasses.replace(stats, autotune=tuner.report())

    def fingerprint(self) -> str | None:
        """What the workers read (``Sampling.fingerprint``), None for a DALI reader."""
        sampling = self.coordinator.sampling() if self.coordinator is not None else None
        return None if sampling is None else sampling.fingerprint

    def worker_names(self) -> list[str] | None:
        """The workers' names for a trace; None when no pool ever started."""
        return None if self.coordinator is None else self.coordinator.worker_names()

    # ------------------------------------------------------------------ epochs
    def after_epoch(self, run: Epoch) -> None:
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

    def hand_out(self, coordinator: Coordinator, delivery: Delivery) -> Any:
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
