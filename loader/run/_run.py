"""The run: what changes per epoch and per layout, between the ``Loader`` (the user's facade) and
the ``Coordinator`` (the event loop over one pool of workers). Runs in the trainer.

::

    Loader ──owns──► Run ──owns──► Launcher ──owns──► Coordinator ──owns──► WorkerPool
      │ (facade)      │ (epochs,      (the layout's       (event loop,         (processes,
      │               │  Progress)     pool; the only      sessions)             sockets,
      │               │                starter)                                  arenas)
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
not handed out. ``state_dict()`` is its encoding (:func:`loader.run._checkpoint.encode_state`,
with the cross-rank gather); ``load_state_dict()`` stores one (a :class:`Resume`) for the next
epoch's start, as torchdata's loaders restore at the next ``iter()``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ipc.wire import Position, RandomStates, Sampling
from workers import steps_left

from ..config import _distributed
from ..config._autotune import Autotuner
from ..config._config import LoaderConfig
from ..engine import _interrupts
from ..engine._coordinator import Coordinator
from ..engine._session import Delivery
from ..engine._stats import LoaderStats
from . import _checkpoint, _ranks
from ._checkpoint import Resume
from ._epochs import Epoch
from ._launcher import Launcher

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
    """One loader's epochs over its lifetime, on the workers its ``launcher`` keeps (the
    current layout's pool and coordinator), and the pending state. See the module docstring for
    who may start or stop processes."""

    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher
        self.timeline = launcher.timeline
        self.counters = launcher.counters
        self.epoch = 0  # the epoch the next iter() runs
        self.current: Epoch | None = None  # the newest epoch (shared with its iterator)
        self.pending: Resume | None = None  # a loaded state, applied at its epoch's start
        self.pending_for: tuple[int, int] | None = None  # the (rank, world size) it was for

    # ------------------------------------------------------------------------------ the pool
    @property
    def config(self) -> LoaderConfig:
        """The configuration as running."""
        return self.launcher.config

    @property
    def autotuner(self) -> Autotuner | None:
        return self.launcher.autotuner

    def launch(self, config: LoaderConfig) -> None:
        """Start the first pool (closes and raises when it does not start)."""
        self.launcher.launch(config)

    def fit_memory(self) -> None:
        self.launcher.fit_memory()

    @property
    def closed(self) -> bool:
        return self.launcher.closed

    def close(self) -> None:
        self.launcher.close()

    def require(self, *, interrupted: bool = False) -> Coordinator:
        """The open coordinator (``LoaderClosedError`` after ``close()`` or a failure; see
        :meth:`Launcher.require` for ``interrupted``)."""
        return self.launcher.require(interrupted=interrupted)

    def planned(self, *, strict: bool = True) -> LoaderConfig:
        """The configuration the next epoch starts with (:meth:`Launcher.planned`)."""
        return self.launcher.planned(self.epoch, live=self._live(), strict=strict)

    def sampling(self) -> Sampling:
        return self.launcher.sampling()

    # ------------------------------------------------------------------------------ observed
    def stats(self, window: float) -> LoaderStats:
        current = self.current  # an epoch over by count: its end is on its way, recorded first
        return self.launcher.stats(window, epoch_over=current is not None and current.finished)

    def fingerprint(self) -> str | None:
        return self.launcher.fingerprint()

    def worker_names(self) -> list[str] | None:
        return self.launcher.worker_names()

    def pids(self) -> list[int]:
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
        """The next batch of ``run`` (``StopIteration`` at its end). An interruption (Ctrl-C's
        ``KeyboardInterrupt``) goes through unchanged; what it leaves: :meth:`_interrupted`."""
        entered = time.perf_counter_ns()
        coordinator = first = self.require()
        polled = coordinator.wait_ns
        if run.replaced:
            raise RuntimeError(
                f"this iterator of epoch {run.epoch} was replaced by a newer iter(loader) or "
                "load_state_dict(); iterate one epoch at a time"
            )
        delivery: Delivery | None = None
        try:
            if not run.started:
                coordinator = self._start(run)
                if coordinator is not first:  # relaunched: the old pool's waits, then the new's
                    polled -= first.wait_ns
            if not run.finished and (run.expected is None or run.delivered < run.expected):
                coordinator.wait_signatures()
                checks = self.launcher.checks
                if not checks.traced_checked:
                    fields = coordinator.agreement_fields()
                    self.launcher.collective(lambda: checks.traced(fields))
                delivery = coordinator.next_batch(run.next_step)
            if delivery is None:  # over (or nothing left: a state saved at its epoch's end)
                self._over(run, entered, self.require().wait_ns - polled)
                raise StopIteration
            info = delivery.info
            batch = self.launcher.hand_out(coordinator, delivery)
            waited = coordinator.wait_ns - polled
            self.timeline.next_call(entered, waited, info.epoch, info.worker_step, info.worker)
            # the user's from here: counted last, so an interruption before leaves it uncounted
            coordinator.handed_out(delivery)
            run.handed_out()
            if run.finished:
                self.launcher.after_epoch(run)
        except BaseException as error:
            if _interrupts.is_interruption(error):
                self._interrupted(error, run, delivery)
            raise
        return batch

    def _interrupted(self, error: BaseException, run: Epoch, delivery: Delivery | None) -> None:
        """``next()`` was interrupted (:mod:`loader.engine._interrupts`). Blocked in a wait for
        a batch, nothing was half-done and the workers go on. Anywhere else they are stopped
        (``LoaderClosedError`` from then on, with these words), and ``delivery``, a batch that
        did not reach the user, is not counted. Either way ``state_dict()`` describes the
        batches handed out: a run resumed from it gets the rest, each batch once."""
        coordinator = self.launcher.coordinator
        if coordinator is None or coordinator.interrupted_cleanly(error):
            return
        if delivery is not None:
            info = delivery.info
            coordinator.take_back(delivery)
            run.take_back(info.step)
            doing = (
                f"handing out batch {info.step} of epoch {info.epoch} (worker {info.worker}), "
                "which was not counted as received"
            )
        elif not run.started:
            doing = f"starting epoch {run.epoch}"
        elif run.finished:
            doing = f"ending epoch {run.epoch}"
        else:
            doing = f"taking batch {run.next_step} of epoch {run.epoch}"
        if coordinator.failure is None:
            coordinator.fail(error, doing)
        logger.info(
            "the workers were stopped: %s; state_dict() still describes the batches handed out",
            coordinator.failure_reason,
        )

    def _over(self, run: Epoch, entered: int, waited: int) -> None:
        over = run.finish()
        if over:
            self.counters.epoch_over(time.monotonic())
        run.leave_accelerate()
        self.timeline.next_call(entered, waited, run.epoch, -1, -1)
        if over:
            self.launcher.after_epoch(run)

    def _start(self, run: Epoch) -> Coordinator:
        """The first ``next()`` of ``run``: the settled rank and decided layout, a loaded state
        or a set epoch applied, the epoch started in every worker."""
        current = self.current
        started = current is not None and current.started
        launcher = self.launcher
        coordinator = launcher.prepare(self.epoch, started=started, loaded_for=self.pending_for)
        if not launcher.checks.configuration_checked and _distributed.group_size() > 1:
            launcher.check_configuration()
        # the loaded state stays pending until the epoch began (after the workers were told,
        # which resets their counts): an interruption before leaves state_dict() describing it
        epoch, resume = self.epoch, self.pending
        if resume is not None and resume.epoch == epoch:  # (set_epoch drops another one)
            shards = _shard_indices(self.config)
            left = coordinator.seek(resume.position, resume.random_states(shards))
            base, cursor = resume.first_turn(shards, left)
            coordinator.start_epoch(epoch, base, cursor)
            run.begin(epoch, sum(left), resume, resume.before)
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
            coordinator.start_epoch(epoch)
            run.begin(epoch, coordinator.steps_per_epoch())
        self.pending = None  # the epoch's own from now on
        self.epoch += 1
        self.counters.iterating(time.monotonic())
        run.join_accelerate()
        return coordinator

    def _abort(self, run: Epoch) -> None:
        """Stop ``run`` in every worker and wait until each has rebuilt its sources."""
        coordinator = self.require()
        run.abort()
        coordinator.abort_epoch(run.epoch)
        logger.info("epoch %d was left early; workers rebuilt their sources", run.epoch)

    # ------------------------------------------------------------------------------ queries
    def length(self) -> int:
        """``len(loader)``: the epoch's length on this rank (a resumed epoch's: received
        before the save plus what is left)."""
        loaded = self._loaded()
        full = self.launcher.epoch_length(self.planned())
        return full if loaded is None else loaded[0].epoch_length(full, loaded[1])

    def remaining(self) -> int:
        """Batches still to come in the epoch in progress (between epochs: in the next one)."""
        current = self.current
        if self._live():
            assert current is not None
            if current.expected is None:
                self.launcher.epoch_length(self.config)  # raises: unknown for this source
            assert current.expected is not None
            return current.expected - current.delivered
        loaded = self._loaded()
        return self.launcher.epoch_length(self.planned()) if loaded is None else loaded[1]

    def progress(self, config: LoaderConfig | None = None) -> Progress:
        """The run's :class:`Progress` (no message to a worker); ``config``: :meth:`planned`,
        when the caller has it already."""
        config = config or self.planned()
        coordinator = self.launcher.require(interrupted=True)
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
            random = tuple(resume.random_states(_shard_indices(config)))
        elif coordinator.next_epoch() == self.epoch and workers == self.config.num_workers:
            random = tuple(coordinator.random_states())
        else:  # set_epoch, or a new layout: the workers start that epoch seeded for it
            random = (b"",) * workers
        return Progress(self.epoch, resume, (0,) * workers, random)

    def state(self) -> dict[str, Any]:
        """``state_dict()``: :meth:`progress` encoded, gathered across ranks (after an
        interruption that stopped the workers too: :meth:`_interrupted`)."""
        sampling = self.launcher.sampling(interrupted=True)
        config = self.planned()
        progress = self.progress(config)
        resume = progress.resume or Resume(Position(progress.epoch, ()))
        return _checkpoint.encode_state(
            sampling, config, resume, progress.epoch, progress.delivered, progress.random
        )

    def load(self, state: Mapping[str, Any], *, strict: bool) -> None:
        """``load_state_dict()``: check ``state`` and keep it for its epoch's start."""
        self.require()
        if self.autotuner is not None:
            self.launcher.resume_layout(state, live=self._live())
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
        left = self._left(resume, config)
        self.pending, self.epoch = resume, resume.epoch
        self.pending_for = (config.rank, config.world_size)
        self.launcher.collective(lambda: _ranks.RankChecks.resumed(left))
        _log_resume(resume, left)

    def _left(self, resume: Resume, config: LoaderConfig) -> int:
        """Batches this rank has left in ``resume``'s epoch on ``config``'s layout."""
        return sum(
            steps_left(
                self.sampling(),
                resume.epoch,
                _shard_indices(config),
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

    # ------------------------------------------------------------------------------ checks


def _shard_indices(config: LoaderConfig) -> list[int]:
    return [shard.index for shard in config.shards]


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
