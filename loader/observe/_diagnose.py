"""``loader.diagnose()``: is the input pipeline the bottleneck, and what to change. Runs in the
trainer.

:func:`diagnose` is a function of one ``stats()`` snapshot (its ``recent`` window: the trainer's
time inside and between ``next()`` calls, each worker's stage times and CPU time) and of the
loader's settings; given the loader's configuration it adds where the rank runs (its host's
CPUs, the local ranks sharing them, the source) and, with a ``torch.distributed`` group up,
every rank's figures (one ``all_gather_object``: a collective, every rank calls it). It reads
nothing else and changes nothing; the policy (thresholds, verdict, advice) is
:mod:`loader.observe._advice`'s.

The verdict, in order:

* input-bound or not: the trainer waited at least :data:`~loader.observe._advice.INPUT_BOUND` of its
  loop's time;
* the stage that took most of the workers' time (``load``, ``dali``, ``blocked``, ``publish``,
  ``idle``; see ``Stages``);
* what the workers are: ``cpu-saturated`` (their CPU time is at least
  :data:`~loader.observe._advice.SATURATED` of the CPUs they share), ``starved of CPU`` (the
  machine's
  load average is at least its CPUs while the workers get less than that: other processes take
  the CPUs), ``waiting on I/O`` (``load`` dominates and is on CPU less than
  :data:`~loader.observe._advice.IO_CPU` of its time), ``blocked on full slots`` (at least half
  their
  time), or busy in their dominant stage;
* one suggestion, with the figure it rests on; the settings every rank shares (``num_workers``,
  ``num_threads``, ``prefetch``, a tar source's ``ahead``) with the same numbers on every rank.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..config import distributed, host_facts
from ..engine import STAGES, LoaderStats
from ._advice import (
    BLOCKED,
    DEFAULT_AHEAD,
    JobAdvice,
    RankFacts,
    agree,
    resolve,
    source_kind,
)

if TYPE_CHECKING:
    from ..config import LoaderConfig


@dataclass(frozen=True)
class Diagnosis:
    """What ``loader.diagnose()`` found over the last ``window_seconds``. ``str()`` is a short
    report; ``verdict`` is its first line and ``suggestion`` its advice; ``job`` the advice for
    the settings every rank shares, the same on every rank."""

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
    cpus: int = 1  # CPUs they share: their host's, split among the local ranks
    load_cpu_fraction: float | None = None  # load()'s CPU time over its wall time (None: no load)
    #: the machine's 1-minute load average and its CPUs (every process, not only the loader's)
    machine_load: float = 0.0
    machine_cpus: int = 1
    verdict: str = ""
    suggestion: str = ""
    rank: int = 0
    world_size: int = 1  # the ranks whose figures the advice rests on
    node_cpus: int = 1  # the CPUs of this rank's host it may use
    local_ranks: int = 1  # the trainer processes sharing them (LOCAL_WORLD_SIZE, or same host)
    #: the settings every rank shares (num_workers, num_threads, prefetch, sharded_tars' ahead),
    #: advised from every rank's figures: the same on every rank; ``job.ranks``: each verdict
    job: JobAdvice = field(default_factory=JobAdvice)
    source: str = ""  # "sharded_tars", "sharded_files", "sharded_mix", "sharded_source" or ""
    #: this process's CPUs and memory and the limits that set them (affinity, a container's
    #: cgroup quota and memory limit): :meth:`ipc.limits.Limits.describe`
    limits: str = ""

    def __str__(self) -> str:
        shares = ", ".join(
            f"{stage} {self.stage_fractions.get(stage, 0.0):.0%}" for stage in STAGES
        )
        budget = ""
        if self.local_ranks > 1 or self.node_cpus != self.cpus:
            budget = f"this rank's share of {self.node_cpus} for {self.local_ranks} local ranks; "
        lines = [
            self.verdict,
            f"  over the last {self.window_seconds:.1f} s ({self.batches} batches): the trainer "
            f"waited {self.waiting_fraction:.1%} of its loop's time for the workers, and "
            f"spent {self.handling_fraction:.1%} of it handing batches out",
            f"  workers: {self.workers}; their time: {shares}",
            f"  workers' CPU: {self.cpu_used:.2f} of {self.cpus} CPUs ({budget}the machine's "
            f"load average: {self.machine_load:.1f} on {self.machine_cpus} CPUs)",
        ]
        if self.limits:
            lines.append(f"  this process may use {self.limits}")
        if self.load_cpu_fraction is not None:
            of = f" of {self.source}" if self.source else ""
            lines.append(f"  load(){of}: on CPU {self.load_cpu_fraction:.0%} of its time")
        lines.append(f"  suggestion: {self.suggestion}")
        if self.world_size > 1:
            for rank, verdict in enumerate(self.job.ranks):
                mine = " (this rank)" if rank == self.rank else ""
                lines.append(f"  rank {rank}{mine}: {verdict}")
            lines.append(f"  every rank: {self.job}")
        return "\n".join(lines)


def rank_facts(
    stats: LoaderStats,
    *,
    num_threads: int,
    prefetch: int,
    in_order: bool,
    load_average: float,
    machine_cpus: int,
    rank: int = 0,
    node_cpus: int | None = None,
    local_ranks: int | None = 1,
    host: str = "",
    peers: int = 1,
    fingerprint: str | None = None,
) -> RankFacts:
    """This rank's figures over the window of ``stats`` (``node_cpus``: default ``stats.cpus``,
    the share the loader computed)."""
    window = stats.window_seconds
    workers = stats.workers
    count = max(1, len(workers))
    fractions = {
        stage: (sum(w.recent.of(stage) for w in workers) / (count * window) if window > 0 else 0.0)
        for stage in STAGES
    }
    read = sum(w.recent.read for w in workers)
    read_cpu = sum(w.recent.read_cpu for w in workers)
    kind, shuffle_window = source_kind(fingerprint)
    return RankFacts(
        rank=rank,
        workers=count,
        threads=num_threads,
        prefetch=prefetch,
        batches=stats.recent_trainer.batches,
        window=window,
        waiting=stats.recent_trainer.waiting_fraction,
        fractions=fractions,
        cpu_used=sum(w.recent.cpu for w in workers) / window if window > 0 else 0.0,
        node_cpus=max(1, stats.cpus if node_cpus is None else node_cpus),
        load_cpu=read_cpu / read if read > 0 else None,
        local_ranks=local_ranks,
        host=host,
        peers=peers,
        contended=load_average >= machine_cpus,
        in_order=in_order,
        source=kind,
        shuffle_window=shuffle_window,
        cpu_quota=None if stats.limits is None else stats.limits.cpu_quota,
    )


def diagnose(
    stats: LoaderStats,
    *,
    num_threads: int,
    prefetch: int,
    in_order: bool,
    machine: tuple[float, int] | None = None,
    config: LoaderConfig | None = None,
    fingerprint: str | None = None,
) -> Diagnosis:
    """The verdict on ``stats`` (a snapshot whose ``recent`` figures cover the window);
    ``machine``: the machine's load average and CPUs (default: this machine's now).

    Without ``config``: one rank, whose workers have ``stats.cpus`` CPUs. With the loader's
    ``config``: this rank's host and local ranks, and with a process group up every rank's
    figures (a collective: every rank must call it); ``fingerprint``: the sharded root's
    (None: not one), which names the source."""
    load_average, machine_cpus = machine or _machine()
    settings: dict[str, Any] = {
        "num_threads": num_threads,
        "prefetch": prefetch,
        "in_order": in_order,
        "load_average": load_average,
        "machine_cpus": machine_cpus,
        "fingerprint": fingerprint,
    }
    if config is None:
        facts = rank_facts(stats, **settings)
        return report(facts, agree([facts]), stats, (load_average, machine_cpus))
    host = host_facts()
    local = host["local_world_size"]
    grouped = distributed.group_size() > 1
    if local is None and not grouped:
        local = config.local_world_size  # (a one-node launcher's WORLD_SIZE, or 1)
    facts = rank_facts(
        stats,
        **settings,
        rank=distributed.group_rank() if grouped else config.rank,
        node_cpus=int(host["node_cpus"]),
        local_ranks=local,
        host=str(host["host"]),
        peers=int(host["peers"]),
    )
    gathered = distributed.gather({"facts": facts.payload()}) if grouped else None
    ranks = [facts] if gathered is None else [RankFacts(**g["facts"]) for g in gathered]
    resolved = resolve(ranks)
    mine = resolved[distributed.group_rank()] if gathered is not None else resolved[0]
    return report(mine, agree(resolved), stats, (load_average, machine_cpus), len(resolved))


def report(
    facts: RankFacts,
    job: JobAdvice,
    stats: LoaderStats,
    machine: tuple[float, int],
    world_size: int = 1,
) -> Diagnosis:
    """The :class:`Diagnosis` of the rank of ``facts``, with the job's advice."""
    load_average, machine_cpus = machine
    trainer = stats.recent_trainer
    return Diagnosis(
        input_bound=facts.input_bound,
        waiting_fraction=facts.waiting,
        handling_fraction=trainer.handling / trainer.loop if trainer.loop > 0 else 0.0,
        window_seconds=facts.window,
        batches=facts.batches,
        dominant_stage=facts.dominant,
        stage_fractions=dict(facts.fractions),
        workers=facts.state,
        cpu_used=facts.cpu_used,
        cpus=facts.cpus,
        load_cpu_fraction=facts.load_cpu,
        machine_load=load_average,
        machine_cpus=machine_cpus,
        verdict=facts.verdict,
        suggestion=suggestion(facts, job, load_average, machine_cpus),
        rank=facts.rank,
        world_size=world_size,
        node_cpus=facts.node_cpus,
        local_ranks=facts.local_ranks or 1,
        job=job,
        source=facts.source,
        limits="" if stats.limits is None else stats.limits.describe(),
    )


def _machine() -> tuple[float, int]:
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = 0.0
    return load, os.cpu_count() or 1


def suggestion(f: RankFacts, job: JobAdvice, load_average: float, machine_cpus: int) -> str:
    """What this rank should change, in a sentence, with the job's numbers for the settings
    every rank shares (so every rank names the same ones)."""
    if not f.judged:
        return (
            f"only {f.batches} batches in {f.window:.1f} s after the first one: iterate longer "
            "(a few seconds of batches) before asking"
        )
    text = _remedy(f, job, load_average, machine_cpus) if f.input_bound else _headroom(f)
    if job.num_workers is not None and f"num_workers={job.num_workers}" not in text:
        text += f"; for the job: num_workers={job.num_workers} ({job.reason})"
    return text


def _headroom(f: RankFacts) -> str:
    blocked = f.fractions.get("blocked", 0.0)
    if blocked >= BLOCKED:
        return (
            f"nothing to change for speed: the workers were blocked on full slots {blocked:.0%} "
            f"of their time (they keep {f.cpu_used:.1f} of {f.cpus_text} busy); fewer workers "
            "would leave CPUs to the trainer"
        )
    return (
        f"nothing to change: the workers keep up ({f.dominant} takes "
        f"{f.fractions.get(f.dominant, 0.0):.0%} of their time, {f.cpu_used:.1f} of {f.cpus} "
        "CPUs busy)"
    )


def _remedy(f: RankFacts, job: JobAdvice, load_average: float, machine_cpus: int) -> str:
    share = f.fractions.get(f.dominant, 0.0)
    if f.starved:
        return (
            f"the machine's CPUs are taken (load average {load_average:.1f} on "
            f"{machine_cpus} CPUs) and the workers get only {f.cpu_used:.1f} of their "
            f"{f.cpus}: more workers will not help; free CPUs (other jobs, the trainer's own "
            "threads) or do less work per sample"
        )
    if f.saturated:
        return (
            f"the workers keep {f.cpu_used:.1f} of {f.cpus_text} busy ({f.dominant} "
            f"{share:.0%} of their time): more workers will not help here; use device='gpu' "
            "decoding, smaller images, or less work in step()"
            + (", or raise the container's CPU limit" if f.capacity < f.cpus else "")
        )
    if f.waits_on_io:
        assert f.load_cpu is not None
        text = (
            f"the workers wait for load() {share:.0%} of their time, and load() is on CPU only "
            f"{f.load_cpu:.0%} of its time (it waits on storage)"
        )
        if f.source == "sharded_tars" and job.ahead is not None:
            text += ": " + _tars_text(f, job.ahead)
            return text + _workers_clause("; more workers would fetch in parallel too", job, False)
        return text + _workers_clause(": more workers load in parallel", job, True)
    if f.dominant in ("load", "dali"):
        where = "load() (one prefetch thread per worker)" if f.dominant == "load" else "DALI"
        text = (
            f"the workers spend {share:.0%} of their time in {where} and keep only "
            f"{f.cpu_used:.1f} of {f.cpus_text} busy"
        )
        threads = None if job.num_threads is None else f"num_threads={job.num_threads}"
        if job.num_workers is not None:
            return f"{text}: try num_workers={job.num_workers}" + (
                f" or {threads}" if threads else ""
            )
        why = job.limit or "no more workers fit"
        return f"{text}: try {threads} ({why})" if threads else f"{text}; {why}"
    if f.dominant == "publish":
        return (
            f"the workers spend {share:.0%} of their time copying batches into shared memory: "
            "deliver fewer bytes (uint8 rather than float32, crop before normalising) or use "
            "device='gpu'"
        )
    if f.dominant == "blocked":
        order = "in_order=False, or " if f.in_order else ""
        prefetch = job.prefetch or 2 * f.prefetch
        return (
            f"the workers are blocked on full slots {share:.0%} of their time while the "
            f"trainer waits: the trainer holds their slots or waits on one late worker; try "
            f"{order}prefetch={prefetch}"
        )
    return (
        f"the workers were idle {share:.0%} of their time: the trainer waited at the start of "
        "epochs; iterate epochs back to back (the next epoch is prefetched once the last batch "
        "of the previous one was taken)"
    )


def _workers_clause(more: str, job: JobAdvice, own_load: bool) -> str:
    """More workers when the job may have them, else why not (``own_load``: your ``load()``,
    which can be told to wait less)."""
    if job.num_workers is not None:
        return f"{more}, try num_workers={job.num_workers}"
    if not job.limit:
        return more
    text = f"{more}, but {job.limit}"
    if own_load:
        text += (
            "; within these CPUs, load() itself must wait less (fewer, larger reads, or reads "
            "in parallel inside it)"
        )
    return text


def _tars_text(f: RankFacts, ahead: int) -> str:
    """``sharded_tars``' own knobs: ``ahead`` (fetches run while earlier shards are read) and
    what it costs in memory, which ``shuffle_window`` trades against."""
    window = f.shuffle_window
    if window is None:  # local shards, or fewer remote ones than a window: no way to tell
        return (
            f"for shards in an object store, fetch further ahead: sharded_tars(..., "
            f"ahead={ahead}) (default {DEFAULT_AHEAD}); each worker then holds {ahead} shards' "
            "bytes in memory besides those it reads, and a smaller shuffle_window holds fewer "
            "(and shuffles less)"
        )
    on_host = (window + ahead) * f.workers * (f.local_ranks or 1)
    return (
        f"fetch shards further ahead, sharded_tars(..., ahead={ahead}) (default "
        f"{DEFAULT_AHEAD}): an ahead of {window} fetches the next group of shuffle_window="
        f"{window} shards whole while one is read; each worker then holds up to "
        f"{window} + {ahead} shards' bytes in memory ({on_host} shards on this host at "
        f"{f.workers} workers per rank); short of "
        "memory, a smaller shuffle_window holds fewer (and shuffles less)"
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
