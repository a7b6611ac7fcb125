"""Each epoch's worker layout, decided in one place: how many workers, DALI threads each, on
which rank. Runs in the trainer.

:class:`LayoutPlan` is the only owner of the layout after the arguments were validated
(:meth:`loader.config.LoaderConfig.build`): the first guess of ``num_workers="auto"`` (every
rank from the smallest budgets of all), the rank a process group settles after the loader was
built, the layout the autotuner decides after an epoch or when the workers started over the
memory budget, and the layout a loaded state was saved on. It holds the configuration as running
and the one decided for the next epoch; it decides and starts nothing: the
:class:`~loader.run._run.Run` starts pools of the configurations it gives
(:class:`~loader.run._launcher.Launcher`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..config import SETTLED_EVERY, Autotuner, AutotuneReport, Layout, LoaderConfig, distributed
from . import _ranks, _tuning

if TYPE_CHECKING:
    from ..engine import Coordinator, Timeline, WorkerFacts

logger = logging.getLogger("loader")


@dataclass(frozen=True)
class EpochLayout:
    """What an epoch's start runs: ``settled``, the configuration at the rank a process group
    gave (``relay``: another rank than the running workers'), and ``config``, that one on the
    layout decided for the epoch (the same object when none was)."""

    settled: LoaderConfig
    relay: bool
    config: LoaderConfig


class LayoutPlan:
    """The layout of the running workers and of the next epoch (module docstring)."""

    def __init__(self, config: LoaderConfig) -> None:
        self.autotuner = first_guess(config)
        if self.autotuner is not None:  # num_workers/num_threads="auto": the first guess
            config = config.with_layout(self.autotuner.layout)
        #: the configuration of the running workers
        self.config = config
        self._next: Layout | None = None  # decided, applied at the next epoch's start

    def planned(self, epoch: int, *, live: bool, strict: bool = True) -> LoaderConfig:
        """The configuration epoch ``epoch`` (the next) starts with (pure: nothing changes); the
        running one while an epoch is ``live``. ``strict=False``: the running configuration
        where the rank cannot be settled yet."""
        if live:
            return self.config
        try:
            config, _relay = self._settle(started=False, loaded_for=None)
        except (ValueError, RuntimeError):
            if strict:
                raise
            return self.config
        return config if self._next is None else config.with_layout(self._next, epoch)

    def next_epoch(
        self, epoch: int, *, started: bool, loaded_for: tuple[int, int] | None
    ) -> EpochLayout:
        """At epoch ``epoch``'s start: the settled rank and the decided layout, now the running
        configuration (``ValueError``/``RuntimeError`` when the rank contradicts an epoch
        ``started`` or a state loaded for another (rank, world size), ``loaded_for``)."""
        settled, relay = self._settle(started=started, loaded_for=loaded_for)
        config = settled
        if self._next is not None:
            config, self._next = settled.with_layout(self._next, epoch), None
        if relay:
            logger.info(
                "rank %d of %d from the process group (the loader was built as rank %d of "
                "%d): restarting its workers for that shard",
                settled.rank,
                settled.world_size,
                self.config.rank,
                self.config.world_size,
            )
        self.config = config
        return EpochLayout(settled, relay, config)

    def _settle(
        self, *, started: bool, loaded_for: tuple[int, int] | None
    ) -> tuple[LoaderConfig, bool]:
        settled, relay = _ranks.settle(self.config, started=started)
        placed = (settled.rank, settled.world_size)
        if loaded_for is not None and relay and loaded_for != placed:
            raise RuntimeError(
                f"a state was loaded while this loader was rank {self.config.rank} of "
                f"{self.config.world_size}, but the torch.distributed group makes it rank "
                f"{settled.rank} of {settled.world_size}: load the state after the process "
                "group is set up (e.g. in the trainer's own restore hook)"
            )
        return settled, relay

    # ------------------------------------------------------------------ num_workers="auto"
    def fit_memory(self, facts: Sequence[WorkerFacts]) -> LoaderConfig | None:
        """At construction, the workers as started: the configuration to start instead when
        they are over the memory budget (a collective under torch.distributed), else None."""
        tuner = self.autotuner
        assert tuner is not None
        decision = _tuning.at_start(tuner, facts, self.config)
        logger.info(
            "num_workers='auto' (tuning %s): starting with %s, %s; budgets: %d CPUs, %.0f MiB",
            tuner.tuning,
            decision.layout,
            decision.reason,
            tuner.cpus,
            tuner.memory_limit / 2**20,
        )
        if not decision.changed:
            return None
        self.config = self.config.with_layout(decision.layout)
        return self.config

    def after_epoch(self, timeline: Timeline, workers: Coordinator, epoch: int) -> None:
        """``epoch`` handed out its last batch from ``workers``: with num_workers="auto",
        measure it and decide the next epoch's layout (a collective under torch.distributed:
        every rank ends an epoch at the same step); the next epoch's start applies it."""
        tuner = self.autotuner
        if tuner is None or (tuner.settled and epoch % SETTLED_EVERY):
            return  # settled: the memory is checked every few epochs (the same on every rank)
        config, was_settled = self.config, tuner.settled
        facts = workers.worker_facts()
        decision = _tuning.after_epoch(tuner, timeline, facts, config, epoch)
        if decision is None:
            return
        if decision.changed:
            logger.info(
                "num_workers='auto': epoch %d runs %s (was %s): %s",
                epoch + 1,
                decision.layout,
                config.layout,
                decision.reason,
            )
            self._next = decision.layout
        elif decision.settled and not was_settled:
            logger.info("num_workers='auto': %s", decision.reason)

    def resume_on(self, state: Mapping[str, Any], *, live: bool) -> None:
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
            self._next = target

    def report(self) -> AutotuneReport | None:
        """What num_workers="auto" chose and why (None without it)."""
        return None if self.autotuner is None else self.autotuner.report()


def first_guess(config: LoaderConfig) -> Autotuner | None:
    """The layout search of num_workers="auto" / num_threads="auto" (None without either). With
    a process group up every rank starts from the same guess: the smallest budgets of all."""
    if not (config.workers_auto or config.threads_auto):
        return None
    cpus, memory_limit = config.cpus, config.memory_limit or 0
    gathered = distributed.gather({"cpus": cpus, "memory_limit": memory_limit})
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
