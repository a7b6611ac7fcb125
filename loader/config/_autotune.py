"""``num_workers="auto"`` / ``num_threads="auto"``: which layout (workers, DALI threads per
worker) to run next. Runs in the trainer.

A policy that returns decisions and never touches a worker: the Loader measures each finished
epoch (:mod:`loader.run._tuning`: the trainer's rate and waits from the timeline, the workers' CPU
time, their memory with psutil), hands the measurement to :meth:`Autotuner.observe`, and applies
the :class:`Decision` it gets back at the epoch boundary (a new pool of workers; the elastic
reshard keeps every epoch exactly once). Every rank feeds its tuner the same measurement (each
rank's combined by :func:`combine`: the slowest rate, the largest wait and memory, the smallest
budgets), so every rank decides the same layout without another message.

The search: start with a guess (two workers, the CPUs split among them); when the trainer waited
for data, try the next layout up the ladder (more workers, or more threads), past this rank's
CPUs (its host's, split among the local ranks) only while the workers left CPUs unused (they
wait on storage), up to :data:`loader.config._env.OVERSUBSCRIBE` workers per CPU, the budget
``loader.diagnose()`` advises within; keep going while the rate
improves by :data:`BETTER`; then try one step down from the start; settle on the fastest layout
measured. A layout whose predicted memory (the largest worker's USS plus its shared-memory slots,
times the workers) is over the budget is never tried, and a measured one over it is left.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ._env import OVERSUBSCRIBE

logger = logging.getLogger("loader")

#: A layout is better than another only when it delivers this much faster (noise margin).
BETTER = 1.05
#: Below this fraction of the loop's time spent waiting for data, the input is not the bottleneck.
NOT_INPUT_BOUND = 0.05
#: Workers that keep fewer than this share of the CPUs busy leave room for more workers.
CPU_BOUND = 0.8
#: Predicted memory of a layout: measured per worker, times the workers, times this margin.
MEMORY_MARGIN = 1.1
#: Before the first epoch, a worker's memory as started times this is its prediction: a worker
#: grows while its pipeline runs (its buffers; with a forkserver, pages it stops sharing).
STARTUP_GROWTH = 2.0
#: Once settled, every this many epochs the layout is measured again (for the memory budget).
SETTLED_EVERY = 4
#: A measurement shorter than this (seconds, batches) is pooled with the next epoch's.
MIN_SECONDS = 0.5
MIN_BATCHES = 8


@dataclass(frozen=True, order=True)
class Layout:
    """Workers of this rank, and DALI threads per worker."""

    workers: int
    threads: int

    def __str__(self) -> str:
        return f"{self.workers} workers x {self.threads} threads"


@dataclass(frozen=True)
class Measurement:
    """One epoch (or a few short ones) on one layout, past each pool's first batches.

    ``rate``: batches the trainer received per second of its loop; ``waiting``: the fraction of
    that loop spent waiting for data; ``worker_cpus``: CPUs the workers kept busy; ``memory``:
    bytes the workers hold (USS plus shared-memory slots), ``worker_memory`` the largest one's;
    ``cpus`` and ``memory_limit``: the budgets it was measured under."""

    layout: Layout
    batches: int
    seconds: float
    waiting: float
    worker_cpus: float
    memory: int
    worker_memory: int
    cpus: int
    memory_limit: int
    epochs: int = 1

    @property
    def rate(self) -> float:
        return self.batches / self.seconds if self.seconds > 0 else 0.0

    def pooled(self, other: Measurement) -> Measurement:
        """This measurement and a later one on the same layout, as one."""
        seconds = self.seconds + other.seconds
        return replace(
            other,
            batches=self.batches + other.batches,
            seconds=seconds,
            waiting=(self.waiting * self.seconds + other.waiting * other.seconds) / seconds
            if seconds > 0
            else other.waiting,
            worker_cpus=max(self.worker_cpus, other.worker_cpus),
            memory=max(self.memory, other.memory),
            worker_memory=max(self.worker_memory, other.worker_memory),
            epochs=self.epochs + other.epochs,
        )

    def payload(self) -> dict[str, Any]:
        return {
            "workers": self.layout.workers,
            "threads": self.layout.threads,
            "batches": self.batches,
            "seconds": self.seconds,
            "waiting": self.waiting,
            "worker_cpus": self.worker_cpus,
            "memory": self.memory,
            "worker_memory": self.worker_memory,
            "cpus": self.cpus,
            "memory_limit": self.memory_limit,
        }


def combine(payloads: Sequence[dict[str, Any]]) -> Measurement:
    """Every rank's measurement as one: the job goes at its slowest rank's pace."""
    slowest = min(payloads, key=lambda p: p["batches"] / p["seconds"] if p["seconds"] else 0.0)
    return Measurement(
        layout=Layout(int(payloads[0]["workers"]), int(payloads[0]["threads"])),
        batches=int(slowest["batches"]),
        seconds=float(slowest["seconds"]),
        waiting=max(float(p["waiting"]) for p in payloads),
        worker_cpus=max(float(p["worker_cpus"]) for p in payloads),
        memory=max(int(p["memory"]) for p in payloads),
        worker_memory=max(int(p["worker_memory"]) for p in payloads),
        cpus=min(int(p["cpus"]) for p in payloads),
        memory_limit=min(int(p["memory_limit"]) for p in payloads),
    )


@dataclass(frozen=True)
class Decision:
    """The layout of the next epoch; ``changed``: the workers must be relaunched for it."""

    layout: Layout
    changed: bool
    settled: bool
    reason: str


@dataclass(frozen=True)
class Trial:
    """One layout as measured: at ``epoch`` (the last epoch of the measurement)."""

    epoch: int
    layout: Layout
    batches_per_second: float
    waiting: float
    worker_cpus: float
    memory: int


@dataclass(frozen=True)
class AutotuneReport:
    """What ``num_workers="auto"`` / ``num_threads="auto"`` chose and why (``stats().autotune``).

    ``tuning``: "workers", "threads" or "workers and threads"; ``layout``: the workers and
    threads of the epoch in progress (or the next); ``settled``: the search is over;
    ``reason``: why this layout; ``cpus`` and ``memory_limit``: the budgets (this rank's);
    ``trials``: each layout measured, in order."""

    tuning: str
    layout: Layout
    settled: bool
    reason: str
    cpus: int
    memory_limit: int
    trials: tuple[Trial, ...] = ()


def first_layout(cpus: int, workers: int | None, threads: int | None) -> Layout:
    """The guess to start from: two workers (one on a single CPU), the CPUs split among them;
    a fixed ``workers`` or ``threads`` (not None) stays."""
    count = workers if workers is not None else min(2, max(1, cpus))
    return Layout(count, threads if threads is not None else max(1, cpus // count))


@dataclass
class Autotuner:
    """The search over layouts. ``workers``/``threads``: a fixed value, or None to tune it;
    ``cpus``: this rank's CPU budget; ``memory_limit``: bytes its workers may hold."""

    cpus: int
    memory_limit: int
    workers: int | None = None
    threads: int | None = None
    layout: Layout = field(init=False)
    settled: bool = False
    reason: str = "the first guess"
    trials: list[Trial] = field(default_factory=list)
    _rates: dict[Layout, float] = field(default_factory=dict)
    _pending: Measurement | None = None
    _start: Layout | None = None
    _too_big: Layout | None = None  # the smallest layout known to be over the memory budget
    _cpu_bound: bool = False

    def __post_init__(self) -> None:
        self.layout = first_layout(self.cpus, self.workers, self.threads)
        self.reason = f"the first guess for {self.cpus} CPUs"

    @property
    def tuning(self) -> str:
        if self.workers is None and self.threads is None:
            return "workers and threads"
        return "workers" if self.workers is None else "threads"

    def ladder(self) -> list[Layout]:
        """The layouts tried, from the least parallel up (a fixed dimension stays fixed)."""
        cpus = max(1, self.cpus)
        if self.workers is None:
            counts = _powers(max(2, OVERSUBSCRIBE * cpus))
            return [Layout(w, self.threads or max(1, cpus // w)) for w in counts]
        counts = sorted(set(_powers(cpus)) | {self.layout.threads})
        return [Layout(self.workers, t) for t in counts]

    def report(self) -> AutotuneReport:
        return AutotuneReport(
            tuning=self.tuning,
            layout=self.layout,
            settled=self.settled,
            reason=self.reason,
            cpus=self.cpus,
            memory_limit=self.memory_limit,
            trials=tuple(self.trials),
        )

    def observe(self, epoch: int, measured: Measurement) -> Decision:
        """The layout after ``epoch``, which ran ``measured.layout`` (the current one)."""
        self.cpus, self.memory_limit = measured.cpus, measured.memory_limit
        if self._pending is not None and self._pending.layout == measured.layout:
            measured = self._pending.pooled(measured)
        self._pending = None
        per_worker = max(measured.worker_memory, measured.memory // max(1, measured.layout.workers))
        over = measured.memory > self.memory_limit
        if over or any(not self._fits(layout, per_worker) for layout in self.ladder()):
            self._note_memory(per_worker)
        if over:
            return self._leave_for_memory(epoch, measured, per_worker)
        if self.settled:
            return self._stay(self.reason)
        if (measured.seconds < MIN_SECONDS or measured.batches < MIN_BATCHES) and (
            measured.epochs < 3
        ):
            self._pending = measured
            return self._stay(
                f"measuring {self.layout}: {measured.batches} batches in "
                f"{measured.seconds:.2f} s are too few, pooled with the next epoch"
            )
        rate = measured.rate
        self._rates[measured.layout] = rate
        self.trials.append(
            Trial(
                epoch,
                measured.layout,
                rate,
                measured.waiting,
                measured.worker_cpus,
                measured.memory,
            )
        )
        if self._start is None:
            self._start = measured.layout
            self._cpu_bound = measured.worker_cpus >= CPU_BOUND * min(
                self.cpus, measured.layout.workers * measured.layout.threads
            )
        facts = (
            f"{rate:.1f} batches/s, the trainer waited {measured.waiting:.0%}, workers kept "
            f"{measured.worker_cpus:.1f} of {self.cpus} CPUs busy, "
            f"{_mib(measured.memory)} of {_mib(self.memory_limit)} memory"
        )
        if measured.waiting < NOT_INPUT_BOUND and len(self._rates) == 1:
            return self._settle(measured.layout, f"not input-bound at {measured.layout}: {facts}")
        best = self._best()
        following = self._next_to_try(best, measured, per_worker)
        if following is not None:
            return self._move(following, f"trying {following}: {measured.layout} gave {facts}")
        tried = ", ".join(f"{layout}: {r:.1f}/s" for layout, r in sorted(self._rates.items()))
        return self._settle(best, f"the fastest measured ({tried}); {measured.layout} gave {facts}")

    def fit(self, memory: int, worker_memory: int) -> Decision:
        """Before the first epoch: the workers as started (``memory`` bytes in all, the largest
        ``worker_memory``) must fit the budget, or fewer start it."""
        layout = self.layout
        per_worker = int(STARTUP_GROWTH * max(worker_memory, memory // max(1, layout.workers)))
        if layout.workers * per_worker * MEMORY_MARGIN <= self.memory_limit:
            return self._stay(self.reason)
        ladder = self.ladder()
        fitting = [other for other in ladder if other < layout and self._fits(other, per_worker)]
        if not fitting:
            return self._stay(self.reason)
        return self._move(
            fitting[-1],
            f"{layout} held {_mib(memory)} once started, {STARTUP_GROWTH:g}x that is over the "
            f"memory budget of {_mib(self.memory_limit)}",
        )

    def rebudget(self, cpus: int) -> bool:
        """Before the first epoch, the CPU budget once every rank's host is known: True when
        the first guess was made for another budget and is replaced by this one's."""
        if cpus == self.cpus:
            return False
        self.cpus = cpus
        if self.trials or self.settled or self.layout in self.ladder():
            return False
        self.layout = first_layout(cpus, self.workers, self.threads)
        self.reason = f"the first guess for {cpus} CPUs (this host's, split among its ranks)"
        return True

    def resume_on(self, workers: int) -> Layout | None:
        """The layout of a state saved with ``workers`` workers (None: none of the ladder's, or
        over the memory budget as measured): the search goes on from it."""
        found = [layout for layout in self.ladder() if layout.workers == workers]
        if not found or (self._too_big is not None and found[0] >= self._too_big):
            return None
        self._pending = None
        self.layout, self.reason = found[0], f"the layout of the state resumed from ({found[0]})"
        return found[0]

    # ------------------------------------------------------------------------------ steps
    def _best(self) -> Layout:
        """The fastest layout measured; a more parallel one only when :data:`BETTER`."""
        best: Layout | None = None
        for layout, rate in sorted(self._rates.items()):
            if best is None or rate > self._rates[best] * BETTER:
                best = layout
        assert best is not None
        return best

    def _next_to_try(self, best: Layout, measured: Measurement, per_worker: int) -> Layout | None:
        ladder = self.ladder()
        if best not in ladder:
            return None
        index = ladder.index(best)
        up = ladder[index + 1] if index + 1 < len(ladder) else None
        down = ladder[index - 1] if index > 0 else None
        room = up is not None and (self._parallel(up) <= self.cpus or not self._cpu_bound)
        if up is not None and room and up not in self._rates and self._fits(up, per_worker):
            return up
        if measured.waiting < NOT_INPUT_BOUND:
            return None  # the best layout feeds the trainer: nothing to gain below it
        assert self._start is not None
        if down is not None and down not in self._rates and best == self._start:
            return down
        return None

    def _parallel(self, layout: Layout) -> int:
        return layout.workers if self.workers is None else layout.threads

    def _fits(self, layout: Layout, per_worker: int) -> bool:
        if self._too_big is not None and layout >= self._too_big:
            return False
        return layout.workers * per_worker * MEMORY_MARGIN <= self.memory_limit or (
            layout.workers == 1
        )

    def _note_memory(self, per_worker: int) -> None:
        for layout in self.ladder():
            if not self._fits(layout, per_worker):
                self._too_big = layout if self._too_big is None else min(layout, self._too_big)
                return

    def _leave_for_memory(self, epoch: int, measured: Measurement, per_worker: int) -> Decision:
        fitting = [
            layout
            for layout in self.ladder()
            if layout < measured.layout and self._fits(layout, per_worker)
        ]
        facts = (
            f"{measured.layout} held {_mib(measured.memory)}, over the memory budget of "
            f"{_mib(self.memory_limit)} ({_mib(per_worker)} per worker)"
        )
        self._too_big = (
            measured.layout if self._too_big is None else min(self._too_big, measured.layout)
        )
        self._rates.pop(measured.layout, None)
        if not fitting:
            logger.warning("%s, and no fewer workers are possible", facts)
            return self._stay(f"{facts}; no smaller layout")
        target = fitting[-1]
        if self.settled:
            return self._settle(target, facts)
        return self._move(target, facts)

    def _stay(self, reason: str) -> Decision:
        if not self.settled:
            self.reason = reason
        return Decision(self.layout, False, self.settled, self.reason)

    def _move(self, layout: Layout, reason: str) -> Decision:
        changed = layout != self.layout
        self.layout, self.reason = layout, reason
        return Decision(layout, changed, False, reason)

    def _settle(self, layout: Layout, reason: str) -> Decision:
        changed = layout != self.layout
        self.layout, self.reason, self.settled = layout, f"settled on {layout}: {reason}", True
        return Decision(layout, changed, True, self.reason)


def _powers(limit: int) -> list[int]:
    values, value = [], 1
    while value <= limit:
        values.append(value)
        value *= 2
    return values


def _mib(value: int) -> str:
    return f"{value / 2**20:.0f} MiB"
