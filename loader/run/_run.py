"""The run: what changes per epoch and per layout, between the ``Loader`` (the user's facade) and
the ``Coordinator`` (the event loop over one pool of workers). Runs in the trainer.

::

    Loader ──owns──► Run ──owns──► Coordinator ──owns──► WorkerPool
      (facade)        │ (epochs,       (event loop,          (processes, sockets, arenas)
                      │  Progress)      sessions)
                      ├──owns──► LayoutPlan (each epoch's layout: the only one that decides it)
                      ├──owns──► Launcher (builds, starts and retires pools; nothing else)
                      └──owns──► Epoch ◄── EpochIterator (the newest epoch; the iterator shares it)

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
not handed out. ``state_dict()`` is its encoding (:func:`loader.run._checkpoint.encode_state`,
with the cross-rank gather); ``load_state_dict()`` stores one (a :class:`Resume`) for the next
epoch's start, as torchdata's loaders restore at the next ``iter()``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

from ipc.wire import Position, Sampling

from ..config import LoaderConfig, distributed
from ..engine import (
    Coordinator,
    Delivery,
    LoaderStats,
    Timeline,
    TrainerCounters,
    check_healable,
    is_interruption,
)
from . import _checkpoint, _ranks
from ._batches import epoch_length, hand_out, stop_interrupted
from ._checkpoint import Resume
from ._epochs import Epoch
from ._launcher import Launcher, usable
from ._layout import LayoutPlan
from ._progress import Progress, between_epochs, left_in, log_resume, shard_indices

logger = logging.getLogger("loader")


class Run:
    """One loader's epochs over its lifetime: the workers of the current layout (its
    coordinator), what each epoch runs on (its :class:`LayoutPlan`), and the pending state.
    Built with its first pool started (closed again when that fails). See the module docstring
    for who may start or stop processes."""

    def __init__(self, config: LoaderConfig) -> None:
        self.layout = LayoutPlan(config)
        config = self.layout.config
        self.counters = TrainerCounters(created=time.monotonic())
        #: every batch's stage times and the trainer's next() calls (stats, diagnose, trace)
        self.timeline = Timeline(config.num_workers)
        self.launcher = Launcher(self.timeline, self.counters)
        self.checks = _ranks.RankChecks()
        self.coordinator: Coordinator | None = None
        self._closed = True  # until a pool is up: close() works on a half-built run
        self._kind: str | None = None  # the output kind of a batch (dict, tuple, one array)
        self.epoch = 0  # the epoch the next iter() runs
        self.current: Epoch | None = None  # the newest epoch (shared with its iterator)
        self.pending: Resume | None = None  # a loaded state, applied at its epoch's start
        self.pending_for: tuple[int, int] | None = None  # the (rank, world size) it was for
        try:
            coordinator = self._launch_first(config)
            if self.layout.autotuner is not None:
                fitted = self.layout.fit_memory(coordinator.worker_facts())
                if fitted is not None:
                    self._launch(fitted, replacing=coordinator)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------------------ the pool
    def _launch(self, config: LoaderConfig, *, replacing: Coordinator | None = None) -> Coordinator:
        """Start ``config``'s pool as the run's (in place of ``replacing``'s, closed first)."""
        replaced = None if replacing is None else self.launcher.retire(replacing, config)
        coordinator = self.coordinator = self.launcher.pool(config)
        self._closed = False
        self.launcher.start(coordinator, config, replaced=replaced)
        return coordinator

    def _launch_first(self, config: LoaderConfig) -> Coordinator:
        """The run's first pool (or the first on a rank a process group settled), checked
        (closed when it does not start or fails a check)."""
        try:
            coordinator = self._launch(config)
            if config.on_error == "skip" or config.max_restarts:
                check_healable(config, coordinator.sampling() is not None)
            if distributed.group_size() > 1 and not self.checks.deferred:  # (every rank here)
                self.checks.configuration(coordinator, self.layout.config)
        except BaseException:
            self.close()
            raise
        self.launcher.started(config)
        return coordinator

    @property
    def closed(self) -> bool:
        """Closed, or shut down after a failure (its pool is closed)."""
        coordinator = self.coordinator
        return self._closed or coordinator is None or coordinator.pool.closed

    def close(self) -> None:
        """Stop the workers and release their shared memory (idempotent, bounded)."""
        self._closed = True
        if self.coordinator is not None:
            self.coordinator.close()

    def require(self, *, interrupted: bool = False) -> Coordinator:
        """The open coordinator (``LoaderClosedError`` after ``close()`` or a failure; see
        :func:`~loader.run._launcher.usable` for ``interrupted``)."""
        return usable(self.coordinator, closed=self._closed, interrupted=interrupted)

    def planned(self, *, strict: bool = True) -> LoaderConfig:
        """The configuration the next epoch starts with: the rank a process group settled and
        the layout decided (the running one, ``layout.config``, while an epoch is live); closes
        the run and raises when the rank contradicts what ran (``strict=False``: the running
        configuration where the rank cannot be settled yet)."""
        try:
            return self.layout.planned(self.epoch, live=self._live(), strict=strict)
        except (ValueError, RuntimeError):
            self.close()
            raise

    def sampling(self, *, interrupted: bool = False) -> Sampling:
        """What the workers sample from (``TypeError`` for a source without positions)."""
        sampling = self.require(interrupted=interrupted).sampling()
        if sampling is None:
            raise TypeError(_checkpoint.NOT_RESUMABLE)
        return sampling

    # ------------------------------------------------------------------------------ observed
    def stats(self, window: float) -> LoaderStats:
        """``stats()``: the coordinator's counters and the trainer's, with the autotuner's
        report (an epoch over by count first has its end recorded: it is on its way)."""
        coordinator, current = self.coordinator, self.current
        assert coordinator is not None
        if current is not None and current.finished and not self.closed:
            coordinator.finish_epoch()
        stats = coordinator.stats(self.counters, window, self.layout.config.cpus)
        report = self.layout.report()
        return stats if report is None else dataclasses.replace(stats, autotune=report)

    def fingerprint(self) -> str | None:
        """What the workers read (``Sampling.fingerprint``), None for a DALI reader."""
        sampling = self.coordinator.sampling() if self.coordinator is not None else None
        return None if sampling is None else sampling.fingerprint

    def worker_names(self) -> list[str] | None:
        """The workers' names for a trace; None when no pool ever started."""
        return None if self.coordinator is None else self.coordinator.worker_names()

    def pids(self) -> list[int]:
        """The running workers' process ids (``LoaderClosedError`` when closed)."""
        return self.require().pids()

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
                current.replace()
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
            was = resume.epoch
            logger.warning(
                f"set_epoch({epoch}): the state loaded for epoch {was} is dropped, epoch {epoch} "
                f"runs from its start (call set_epoch({was}), or nothing, to resume that state)"
            )
            self.pending = None
        self.epoch = epoch

    def next_batch(self, epoch: Epoch) -> Any:
        """The next batch of ``epoch`` (``StopIteration`` at its end). An interruption (Ctrl-C's
        ``KeyboardInterrupt``) goes through unchanged (what it leaves: ``stop_interrupted``)."""
        entered = time.perf_counter_ns()
        coordinator = first = self.require()
        polled = coordinator.wait_ns
        if epoch.replaced:
            raise RuntimeError(
                f"this iterator of epoch {epoch.epoch} was replaced by a newer iter(loader) or "
                "load_state_dict(); iterate one epoch at a time"
            )
        delivery: Delivery | None = None
        try:
            if not epoch.started:
                coordinator = self._start(epoch)
                if coordinator is not first:  # relaunched: the old pool's waits, then the new's
                    polled -= first.wait_ns
            if not epoch.finished and (epoch.expected is None or epoch.delivered < epoch.expected):
                coordinator.wait_signatures()
                checks = self.checks
                if not checks.traced_checked:
                    fields = coordinator.agreement_fields()
                    checks.traced(coordinator, fields)
                delivery = coordinator.next_batch(epoch.next_step)
            if delivery is None:  # over (or nothing left: a state saved at its epoch's end)
                self._over(epoch, entered, self.require().wait_ns - polled)
                raise StopIteration
            info = delivery.info
            if self._kind is None:
                self._kind = coordinator.output_kind(delivery.info.worker)
            batch = hand_out(coordinator, delivery, self.layout.config, self.counters, self._kind)
            waited = coordinator.wait_ns - polled
            self.timeline.next_call(entered, waited, info.epoch, info.worker_step, info.worker)
            # the user's from here: counted last, so an interruption before leaves it uncounted
            coordinator.handed_out(delivery)
            epoch.handed_out()
            if epoch.finished and not epoch.replaced:
                self.layout.after_epoch(self.timeline, self.require(), epoch.epoch)
        except BaseException as error:
            if is_interruption(error):
                stop_interrupted(self.coordinator, error, epoch, delivery)
            raise
        return batch

    def _over(self, epoch: Epoch, entered: int, waited: int) -> None:
        over = epoch.finish()
        if over:
            self.counters.epoch_over(time.monotonic())
        epoch.leave_accelerate()
        self.timeline.next_call(entered, waited, epoch.epoch, -1, -1)
        if over and not epoch.replaced:
            self.layout.after_epoch(self.timeline, self.require(), epoch.epoch)

    def _start(self, epoch: Epoch) -> Coordinator:
        """The first ``next()`` of ``epoch``: the settled rank and decided layout, a loaded state
        or a set epoch applied, the epoch started in every worker."""
        current = self.current
        started = current is not None and current.started
        coordinator = self._prepare(started)
        if not self.checks.configuration_checked and distributed.group_size() > 1:
            self.checks.configuration(coordinator, self.layout.config)
        # the loaded state stays pending until the epoch began (after the workers were told,
        # which resets their counts): an interruption before leaves state_dict() describing it
        number, resume = self.epoch, self.pending
        if resume is not None and resume.epoch == number:  # (set_epoch drops another one)
            shards = shard_indices(self.layout.config)
            left = coordinator.seek(resume.position, resume.random_states(shards))
            base, cursor = resume.first_turn(shards, left)
            coordinator.start_epoch(number, base, cursor)
            epoch.begin(number, sum(left), resume, resume.before)
        else:
            ready = coordinator.next_epoch()
            if ready != number:  # set_epoch: another epoch than the workers are ready for
                coordinator.seek(Position(number, ()))
                logger.info(
                    "epoch %d starts as the trainer set it (set_epoch): the workers rebuilt "
                    "their sources for it (they were ready for epoch %s)",
                    number,
                    ready,
                )
            coordinator.start_epoch(number)
            epoch.begin(number, coordinator.steps_per_epoch())
        self.pending = None  # the epoch's own from now on
        self.epoch += 1
        self.counters.iterating(time.monotonic())
        epoch.join_accelerate()
        return coordinator

    def _prepare(self, started: bool) -> Coordinator:
        """At the next epoch's start: the rank settled and the layout decided, each a new pool
        when it differs from the running one (the only place, with the constructor and
        close(), that workers start, stop or are replaced)."""
        coordinator = self.require()
        try:
            layout = self.layout.next_epoch(
                self.epoch, started=started, loaded_for=self.pending_for
            )
        except (ValueError, RuntimeError):
            self.close()
            raise
        if layout.relay:
            coordinator.close()
            self.checks.defer()  # no collective here: other ranks may not re-lay
            coordinator = self._launch_first(layout.settled)
        if layout.config is not layout.settled:
            coordinator = self._launch(layout.config, replacing=coordinator)
        return coordinator

    def _abort(self, epoch: Epoch) -> None:
        """Stop ``epoch`` in every worker and wait until each has rebuilt its sources."""
        coordinator = self.require()
        epoch.abort()
        coordinator.abort_epoch(epoch.epoch)
        logger.info("epoch %d was left early; workers rebuilt their sources", epoch.epoch)

    # ------------------------------------------------------------------------------ queries
    def length(self) -> int:
        """``len(loader)``: the epoch's length on this rank (a resumed epoch's: received
        before the save plus what is left)."""
        loaded = self._loaded()
        planned = self.planned()
        full = epoch_length(self.require(), planned)
        return full if loaded is None else loaded[0].epoch_length(full, loaded[1])

    def remaining(self) -> int:
        """Batches still to come in the epoch in progress (between epochs: in the next one)."""
        current = self.current
        if self._live():
            assert current is not None
            if current.expected is None:
                epoch_length(self.require(), self.layout.config)  # raises: unknown here
            assert current.expected is not None
            return current.expected - current.delivered
        loaded = self._loaded()
        if loaded is not None:
            return loaded[1]
        planned = self.planned()
        return epoch_length(self.require(), planned)

    def state(self) -> dict[str, Any]:
        """``state_dict()``: :meth:`progress` encoded, gathered across ranks (after an
        interruption that stopped the workers too))."""
        sampling = self.sampling(interrupted=True)
        config = self.planned()
        coordinator = self.require(interrupted=True)
        current = self.current
        if self._live():
            assert current is not None
            progress = Progress(
                current.epoch,
                current.resume,
                tuple(coordinator.delivered()),
                tuple(coordinator.random_states()),
            )
        else:
            running = self.layout.config.num_workers
            progress = between_epochs(coordinator, self.epoch, self.pending, config, running)
        resume = progress.resume or Resume(Position(progress.epoch, ()))
        return _checkpoint.encode_state(
            sampling, config, resume, progress.epoch, progress.delivered, progress.random
        )

    def load(self, state: Mapping[str, Any], *, strict: bool) -> None:
        """``load_state_dict()``: check ``state`` and keep it for its epoch's start."""
        self.require()
        self.layout.resume_on(state, live=self._live())
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
            current.replace()  # its iterator is done; the next iter() stops it
        left = left_in(resume, self.sampling(), config)
        self.pending, self.epoch = resume, resume.epoch
        self.pending_for = (config.rank, config.world_size)
        self.checks.resumed(self.require(), left)
        log_resume(resume, left)

    def _loaded(self) -> tuple[Resume, int] | None:
        """The loaded state of the epoch in progress (between epochs: of the next one), and
        the batches this rank had left at its start; None for an epoch run from its start."""
        current = self.current
        if self._live():
            assert current is not None
            resume = current.resume
            return None if resume is None else (resume, current.expected or 0)
        if self.pending is not None:
            return self.pending, left_in(self.pending, self.sampling(), self.planned())
        return None

    def _live(self) -> bool:
        """An epoch is being delivered (not replaced by a loaded state)."""
        current = self.current
        return current is not None and current.in_progress and not current.replaced
