"""``loader.diagnose()``: is the input pipeline the bottleneck, and what to change. Runs in the
trainer.

A policy like the others: :func:`diagnose` is a function of one ``stats()`` snapshot (its
``recent`` window: the trainer's time inside and between ``next()`` calls, each worker's stage
times and CPU time) and of the loader's settings, and returns a :class:`Diagnosis`. It reads
nothing else and changes nothing. The thresholds are module constants, named below.

The verdict, in order:

* input-bound or not: the trainer waited at least :data:`INPUT_BOUND` of its loop's time;
* the stage that took most of the workers' time (``load``, ``dali``, ``blocked``, ``publish``,
  ``idle``; see ``Stages``);
* what the workers are: ``cpu-saturated`` (their CPU time is at least :data:`SATURATED` of the
  CPUs they share), ``starved of CPU`` (the machine's load average is at least its CPUs while
  the workers get less than that: other processes take the CPUs), ``waiting on I/O`` (``load``
  dominates and is on CPU less than :data:`IO_CPU` of its time), ``blocked on full slots`` (at
  least half their time), or busy in their dominant stage;
* one suggestion, with the figure it rests on.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._stats import STAGES, LoaderStats

#: The trainer waited at least this fraction of its loop's time: input-bound.
INPUT_BOUND = 0.05
#: The workers' CPU time is at least this fraction of the CPUs they share: saturated.
SATURATED = 0.85
#: ``load`` was on CPU less than this fraction of its wall time: it waits on storage (or sleeps).
IO_CPU = 0.5
#: Workers blocked on full slots at least this fraction of their time: the trainer is slower.
BLOCKED = 0.5
#: Fewer batches than this in the window: too little to judge.
MIN_BATCHES = 8


@dataclass(frozen=True)
class Diagnosis:
    """What ``loader.diagnose()`` found over the last ``window_seconds``. ``str()`` is a short
    report; ``verdict`` is its first line and ``suggestion`` its advice."""

    input_bound: bool
    #: the fraction of the training loop's time spent inside ``next()`` waiting for data
    waiting_fraction: float
    #: the fraction spent inside ``next()`` otherwise: the loader's own work per batch
    handling_fraction: float
    window_seconds: float
    batches: int  # batches the trainer received in the window
    #: the stage that took most of the workers' time, and each stage's share of it
    dominant_stage: str
    stage_fractions: dict[str, float] = field(default_factory=dict)
    #: "cpu-saturated", "waiting on I/O", "blocked on full slots" or "busy in <stage>"
    workers: str = ""
    cpu_used: float = 0.0  # CPUs the workers kept busy, on average
    cpus: int = 1  # CPUs they share
    load_cpu_fraction: float | None = None  # load()'s CPU time over its wall time (None: no load)
    #: the machine's 1-minute load average and its CPUs (every process, not only the loader's)
    machine_load: float = 0.0
    machine_cpus: int = 1
    verdict: str = ""
    suggestion: str = ""

    def __str__(self) -> str:
        shares = ", ".join(
            f"{stage} {self.stage_fractions.get(stage, 0.0):.0%}" for stage in STAGES
        )
        lines = [
            self.verdict,
            f"  over the last {self.window_seconds:.1f} s ({self.batches} batches): the trainer "
            f"waited {self.waiting_fraction:.1%} of its loop's time for the workers, and "
            f"spent {self.handling_fraction:.1%} of it handing batches out",
            f"  workers: {self.workers}; their time: {shares}",
            f"  workers' CPU: {self.cpu_used:.2f} of {self.cpus} CPUs (the machine's load "
            f"average: {self.machine_load:.1f} on {self.machine_cpus} CPUs)",
        ]
        if self.load_cpu_fraction is not None:
            lines.append(f"  load(): on CPU {self.load_cpu_fraction:.0%} of its time")
        lines.append(f"  suggestion: {self.suggestion}")
        return "\n".join(lines)


def diagnose(
    stats: LoaderStats,
    *,
    num_threads: int,
    prefetch: int,
    in_order: bool,
    machine: tuple[float, int] | None = None,
) -> Diagnosis:
    """The verdict on ``stats`` (a snapshot whose ``recent`` figures cover the window);
    ``machine``: the machine's load average and CPUs (default: this machine's now)."""
    load_average, machine_cpus = machine or _machine()
    window = stats.window_seconds
    trainer = stats.recent_trainer
    waiting = trainer.waiting_fraction
    workers = stats.workers
    count = max(1, len(workers))
    fractions = {
        stage: (sum(w.recent.of(stage) for w in workers) / (count * window) if window > 0 else 0.0)
        for stage in STAGES
    }
    dominant = max(STAGES, key=lambda stage: fractions[stage])
    cpus = max(1, stats.cpus)
    cpu_used = sum(w.recent.cpu for w in workers) / window if window > 0 else 0.0
    read = sum(w.recent.read for w in workers)
    read_cpu = sum(w.recent.read_cpu for w in workers)
    load_cpu = read_cpu / read if read > 0 else None
    saturated = cpu_used >= SATURATED * cpus
    contended = not saturated and load_average >= machine_cpus
    waits_on_io = dominant == "load" and load_cpu is not None and load_cpu < IO_CPU
    if fractions["blocked"] >= BLOCKED:
        state = "blocked on full slots"
    elif saturated:
        state = "cpu-saturated"
    elif contended and dominant != "load":
        state = "starved of CPU"
    elif waits_on_io:
        state = "waiting on I/O"
    else:
        state = f"busy in {dominant}"
    input_bound = waiting >= INPUT_BOUND
    facts = _Facts(
        waiting,
        fractions,
        dominant,
        cpu_used,
        cpus,
        load_cpu,
        count,
        num_threads,
        prefetch,
        load_average,
        machine_cpus,
    )
    if trainer.batches < MIN_BATCHES or window <= 0:
        verdict = "too little to judge"
        suggestion = (
            f"only {trainer.batches} batches in {window:.1f} s after the first one: iterate "
            "longer (a few seconds of batches) before asking"
        )
    elif not input_bound:
        verdict = f"not input-bound: the trainer waited {waiting:.1%} of the time"
        suggestion = _headroom(facts)
    else:
        verdict = f"input-bound: the trainer waited {waiting:.0%} of the time"
        suggestion = _remedy(facts, saturated or state == "starved of CPU", waits_on_io, in_order)
    return Diagnosis(
        input_bound=input_bound and verdict != "too little to judge",
        waiting_fraction=waiting,
        handling_fraction=trainer.handling / trainer.loop if trainer.loop > 0 else 0.0,
        window_seconds=window,
        batches=trainer.batches,
        dominant_stage=dominant,
        stage_fractions=fractions,
        workers=state,
        cpu_used=cpu_used,
        cpus=cpus,
        load_cpu_fraction=load_cpu,
        machine_load=load_average,
        machine_cpus=machine_cpus,
        verdict=verdict,
        suggestion=suggestion,
    )


@dataclass(frozen=True)
class _Facts:
    waiting: float
    fractions: dict[str, float]
    dominant: str
    cpu_used: float
    cpus: int
    load_cpu: float | None
    workers: int
    num_threads: int
    prefetch: int
    load_average: float
    machine_cpus: int


def _machine() -> tuple[float, int]:
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = 0.0
    return load, os.cpu_count() or 1


def _headroom(f: _Facts) -> str:
    blocked = f.fractions["blocked"]
    if blocked >= BLOCKED:
        return (
            f"nothing to change for speed: the workers were blocked on full slots {blocked:.0%} "
            f"of their time (they keep {f.cpu_used:.1f} of {f.cpus} CPUs busy); fewer workers "
            "would leave CPUs to the trainer"
        )
    return (
        f"nothing to change: the workers keep up ({f.dominant} takes "
        f"{f.fractions[f.dominant]:.0%} of their time, {f.cpu_used:.1f} of {f.cpus} CPUs busy)"
    )


def _remedy(f: _Facts, saturated: bool, waits_on_io: bool, in_order: bool) -> str:
    share = f.fractions[f.dominant]
    needed = math.ceil(f.workers / max(0.05, 1.0 - f.waiting))  # to stop waiting, if it scaled
    if saturated and f.cpu_used < SATURATED * f.cpus:
        return (
            f"the machine's CPUs are taken (load average {f.load_average:.1f} on "
            f"{f.machine_cpus} CPUs) and the workers get only {f.cpu_used:.1f} of their "
            f"{f.cpus}: more workers will not help; free CPUs (other jobs, the trainer's own "
            "threads) or do less work per sample"
        )
    if saturated:
        return (
            f"the workers keep {f.cpu_used:.1f} of {f.cpus} CPUs busy ({f.dominant} "
            f"{share:.0%} of their time): more workers will not help here; use device='gpu' "
            "decoding, smaller images, or less work in step()"
        )
    if f.dominant == "load" and waits_on_io:
        assert f.load_cpu is not None
        more = max(f.workers + 1, needed)
        return (
            f"the workers wait for load() {share:.0%} of their time, and load() is on CPU only "
            f"{f.load_cpu:.0%} of its time (it waits on storage): more workers load in "
            f"parallel, try num_workers={more}"
        )
    if f.dominant in ("load", "dali"):
        per_worker = f.cpu_used / f.workers
        fit = math.floor(f.cpus / per_worker) if per_worker > 0 else needed
        more = max(f.workers + 1, min(needed, fit))
        where = "load() (one prefetch thread per worker)" if f.dominant == "load" else "DALI"
        threads = ""
        if f.dominant == "dali":
            threads = f" or num_threads={f.num_threads + 1}"
        return (
            f"the workers spend {share:.0%} of their time in {where} and keep only "
            f"{f.cpu_used:.1f} of {f.cpus} CPUs busy: try num_workers={more}{threads}"
        )
    if f.dominant == "publish":
        return (
            f"the workers spend {share:.0%} of their time copying batches into shared memory: "
            "deliver fewer bytes (uint8 rather than float32, crop before normalising) or use "
            "device='gpu'"
        )
    if f.dominant == "blocked":
        order = "in_order=False, or " if in_order else ""
        return (
            f"the workers are blocked on full slots {share:.0%} of their time while the "
            f"trainer waits: the trainer holds their slots or waits on one late worker; try "
            f"{order}prefetch={2 * f.prefetch}"
        )
    return (
        f"the workers were idle {share:.0%} of their time: the trainer waited at the start of "
        "epochs; iterate epochs back to back (the next epoch is prefetched once the last batch "
        "of the previous one was taken)"
    )


def measure_headspace(
    batches: Sequence[Any], train_step: Callable[[Any], None], count: int
) -> float:
    """Headspace: batches per second of ``train_step`` alone, over ``count`` steps on
    ``batches`` (kept in memory, replayed in turn): how fast the training loop would go if
    data were free. Compare it with the rate with the loader."""
    if not batches or count < 1:
        raise ValueError("headspace needs at least one batch and one step")
    started = time.perf_counter()
    for step in range(count):
        train_step(batches[step % len(batches)])
    elapsed = time.perf_counter() - started
    return count / elapsed if elapsed > 0 else float("inf")
