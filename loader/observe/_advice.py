"""What ``loader.diagnose()`` advises: the verdict on each rank's figures, and the settings every
rank must share, advised alike on every rank. Runs in the trainer.

A policy: figures in, advice out; it reads nothing else and changes nothing.
:class:`RankFacts` is one rank's window (``stats().recent``: the trainer's wait, the workers'
stage times and CPU time) with where it runs (its host's CPUs, the local ranks sharing them).
:func:`agree` takes every rank's facts (one ``all_gather_object`` under ``torch.distributed``;
one rank's without) and returns the :class:`JobAdvice`: ``num_workers``, ``num_threads`` and
``prefetch`` must be the same on every rank, so their advice is computed once from every rank's
figures, and every rank gets the same; a tar source's ``ahead`` too (one ``source`` for all
ranks). The verdict (input-bound or not, what the workers are) stays per rank.

The budget: a rank's workers share its host's CPUs with the other local ranks
(``LOCAL_WORLD_SIZE``, else the ranks on the same host): ``node CPUs // local ranks`` each,
one worker per CPU, up to :data:`loader.config._env.OVERSUBSCRIBE` per CPU when their measured CPU
use leaves room (a ``load`` that waits on storage), the same budget ``num_workers="auto"``
searches. The job's worker count is the largest any input-bound rank asks for, within the
smallest budget of any rank; none when an input-bound rank's workers already use its CPUs (the
job goes at its slowest rank's pace, and more workers would not speed that rank up).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..config import OVERSUBSCRIBE, local_ranks, worker_budget
from ..engine import STAGES

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
#: ``sharded_tars``'s default ``ahead``, and the most the advice names.
DEFAULT_AHEAD = 2
MAX_AHEAD = 8

#: A sharded root's fingerprint prefix, and the function that made it.
SOURCE_KINDS = {
    "tars:": "sharded_tars",
    "files:": "sharded_files",
    "mix:": "sharded_mix",  # (0.3's: a state's)
    "mix2:": "sharded_mix",
    "parquet:": "sharded_parquet",
    "hf-dataset:": "sharded_parquet",  # (a datasets.Dataset's Arrow files)
}


def source_kind(fingerprint: str | None) -> tuple[str, int | None]:
    """The source function behind a sharded root's fingerprint (``""``: not a sharded root, a
    DALI reader or your own ExternalSource), and a tar source's ``shuffle_window`` when it
    shuffles fewer shards than it has."""
    if fingerprint is None:
        return "", None
    for prefix, kind in SOURCE_KINDS.items():
        if fingerprint.startswith(prefix):
            window = re.search(r"\+window(\d+)", fingerprint)
            return kind, int(window.group(1)) if window and kind == "sharded_tars" else None
    return "sharded_source", None


@dataclass(frozen=True)
class RankFacts:
    """One rank's figures over the window, and where it runs: what every rank sends the others.

    ``window``: the seconds the figures cover; ``fractions``: each stage's share of the workers'
    time; ``cpu_used``: CPUs the workers kept busy; ``load_cpu``: ``load()``'s CPU time over
    its wall time (None: no ``load``); ``node_cpus``: the CPUs of this rank's host it may use;
    ``local_ranks``: the trainer processes sharing them (``LOCAL_WORLD_SIZE``; None: the ranks
    of the same ``host``); ``peers``: pytest-xdist workers sharing them too; ``contended``: the
    machine's load average is at least its CPUs; ``source``/``shuffle_window``: see
    :func:`source_kind`."""

    rank: int
    workers: int
    threads: int
    prefetch: int
    batches: int
    window: float
    waiting: float
    fractions: dict[str, float]
    cpu_used: float
    node_cpus: int
    load_cpu: float | None = None
    local_ranks: int | None = 1
    host: str = ""
    peers: int = 1
    contended: bool = False
    in_order: bool = True
    source: str = ""
    shuffle_window: int | None = None
    cpu_quota: float | None = None  # the CPUs its host's cgroup quota allows (None: no quota)

    @property
    def capacity(self) -> float:
        """The CPUs this rank's workers can keep busy: :attr:`cpus`, or less under a cgroup
        quota of a fraction of a CPU (0.5: Docker's ``--cpus=0.5``)."""
        if self.cpu_quota is None:
            return float(self.cpus)
        shared = self.cpu_quota / ((self.local_ranks or 1) * max(1, self.peers))
        return min(float(self.cpus), shared)

    @property
    def cpus_text(self) -> str:
        """:attr:`capacity` in words: "4 CPUs", or "its 0.5-CPU quota"."""
        if self.capacity < self.cpus:
            return f"{self.cpus} CPUs (a {self.capacity:.2g}-CPU cgroup quota)"
        return f"{self.cpus} CPUs"

    @property
    def cpus(self) -> int:
        """This rank's CPU budget: its host's CPUs split among the processes sharing them."""
        return max(1, self.node_cpus // ((self.local_ranks or 1) * max(1, self.peers)))

    @property
    def judged(self) -> bool:
        return self.batches >= MIN_BATCHES and self.window > 0

    @property
    def input_bound(self) -> bool:
        return self.judged and self.waiting >= INPUT_BOUND

    @property
    def dominant(self) -> str:
        return max(STAGES, key=lambda stage: self.fractions.get(stage, 0.0))

    @property
    def saturated(self) -> bool:
        return self.cpu_used >= SATURATED * self.capacity

    @property
    def starved(self) -> bool:
        """Other processes take the CPUs: the machine is loaded, and the workers, busy on the
        CPU (in DALI or copying), get less than theirs."""
        return not self.saturated and self.contended and self.dominant in ("dali", "publish")

    @property
    def waits_on_io(self) -> bool:
        return self.dominant == "load" and self.load_cpu is not None and self.load_cpu < IO_CPU

    @property
    def state(self) -> str:
        """What the workers are: blocked, saturated, starved, waiting on I/O or busy."""
        if self.fractions.get("blocked", 0.0) >= BLOCKED:
            return "blocked on full slots"
        if self.saturated:
            return "cpu-saturated"
        if self.starved:
            return "starved of CPU"
        if self.waits_on_io:
            return "waiting on I/O"
        return f"busy in {self.dominant}"

    @property
    def budget(self) -> int:
        """The most workers this rank may run (see :func:`loader.config._env.worker_budget`)."""
        return worker_budget(self.cpus, self.cpu_used / max(1, self.workers))

    @property
    def verdict(self) -> str:
        if not self.judged:
            return "too little to judge"
        if not self.input_bound:
            return f"not input-bound: the trainer waited {self.waiting:.1%} of the time"
        return f"input-bound: the trainer waited {self.waiting:.0%} of the time"

    def payload(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


@dataclass(frozen=True)
class Wish:
    """What one rank's figures ask of the settings every rank shares (None: nothing)."""

    rank: int
    workers: int | None = None
    why: str = ""  # what the workers do, for the job's reason
    veto: str = ""  # more workers would not help this rank, and why
    threads: int | None = None
    prefetch: int | None = None
    ahead: int | None = None


def wish(facts: RankFacts) -> Wish:
    """What ``facts`` ask for, before the budget: nothing unless the rank is input-bound."""
    f = facts
    if not f.input_bound:
        return Wish(f.rank)
    share = f.fractions.get(f.dominant, 0.0)
    if f.saturated:
        veto = f"its workers keep {f.cpu_used:.1f} of its {f.cpus_text} busy"
        return Wish(f.rank, veto=veto)
    if f.starved:
        return Wish(f.rank, veto="the host's CPUs are taken by other processes")
    needed = math.ceil(f.workers / max(0.05, 1.0 - f.waiting))  # to stop waiting, if it scaled
    if f.waits_on_io:
        assert f.load_cpu is not None
        ahead = None
        if f.source == "sharded_tars":
            ahead = min(MAX_AHEAD, max(DEFAULT_AHEAD + 1, f.shuffle_window or 0))
        why = (
            f"waits for load() {share:.0%} of its workers' time, and load() is on CPU "
            f"{f.load_cpu:.0%} of it"
        )
        return Wish(f.rank, max(f.workers + 1, needed), why, ahead=ahead)
    if f.dominant in ("load", "dali"):
        per_worker = f.cpu_used / max(1, f.workers)
        fit = math.floor(f.cpus / per_worker) if per_worker > 0 else needed
        threads = f.threads + 1 if f.dominant == "dali" else None
        why = (
            f"spends {share:.0%} of its workers' time in {f.dominant}, with "
            f"{f.cpu_used:.1f} of its {f.cpus_text} busy"
        )
        return Wish(f.rank, max(f.workers + 1, min(needed, fit)), why, threads=threads)
    if f.dominant == "blocked":
        return Wish(f.rank, prefetch=2 * f.prefetch)
    return Wish(f.rank)


@dataclass(frozen=True)
class JobAdvice:
    """The settings every rank must share, advised alike on every rank from every rank's
    figures (None: keep it). ``budget``: the most workers per rank the hosts' CPUs allow (the
    smallest rank's); ``reason``: why ``num_workers`` is advised or not (empty: nothing asks
    for more workers); ``limit``: what keeps it from more workers, when something does (a
    rank whose workers use its CPUs, or the budget); ``ranks``: every rank's verdict, in rank
    order."""

    num_workers: int | None = None
    num_threads: int | None = None
    prefetch: int | None = None
    ahead: int | None = None
    budget: int = 1
    reason: str = ""
    limit: str = ""
    ranks: tuple[str, ...] = field(default_factory=tuple)

    @property
    def settings(self) -> dict[str, int]:
        """The advised settings by name (the Loader's, and ``ahead`` of ``sharded_tars``)."""
        named = {
            "num_workers": self.num_workers,
            "num_threads": self.num_threads,
            "prefetch": self.prefetch,
            "ahead": self.ahead,
        }
        return {name: value for name, value in named.items() if value is not None}

    def __str__(self) -> str:
        settings = ", ".join(f"{name}={value}" for name, value in self.settings.items())
        text = settings or "keep the settings"
        return f"{text} ({self.reason})" if self.reason else text


def resolve(ranks: Sequence[RankFacts]) -> list[RankFacts]:
    """Every rank's facts with its local ranks counted: ``LOCAL_WORLD_SIZE`` when it was set,
    else the ranks of the same host."""
    hosts = [f.host for f in ranks]
    return [
        f if f.local_ranks is not None else replace(f, local_ranks=local_ranks(hosts, i, None))
        for i, f in enumerate(ranks)
    ]


def agree(ranks: Sequence[RankFacts]) -> JobAdvice:
    """The advice for the settings every rank shares, from every rank's facts (in rank order):
    the same list gives the same advice on every rank."""
    ranks = resolve(ranks)
    wishes = [wish(f) for f in ranks]
    limiting = min(ranks, key=lambda f: (f.budget, f.rank))
    budget = limiting.budget
    current = max(f.workers for f in ranks)
    vetoes = [w for w in wishes if w.veto]
    wants = [w for w in wishes if w.workers is not None]
    workers: int | None = None
    reason = limit = ""
    if vetoes:
        veto = vetoes[0]
        reason = limit = (
            f"rank {veto.rank} waits for its workers and {veto.veto}: more workers would not "
            "speed it up, and the job goes at its slowest rank's pace"
        )
    elif wants:
        top = max(wants, key=lambda w: (w.workers or 0, -w.rank))
        asked = top.workers or 0
        target = min(asked, budget)
        room = _budget_text(limiting)
        if target > current:
            workers = target
            capped = f" ({asked} would stop the wait)" if asked > target else ""
            reason = (
                f"rank {top.rank} {top.why}; {target} workers per rank is within the budget "
                f"of {budget}{capped}: {room}"
            )
        else:
            limit = f"{current} workers per rank is already the most the CPUs allow ({room})"
            reason = f"rank {top.rank} {top.why}, and {limit}"
    threads = None if vetoes else _most(w.threads for w in wishes)
    return JobAdvice(
        num_workers=workers,
        num_threads=threads,
        prefetch=_most(w.prefetch for w in wishes),
        ahead=_most(w.ahead for w in wishes),
        budget=budget,
        reason=reason,
        limit=limit,
        ranks=tuple(f.verdict for f in ranks),
    )


def _most(values: Any) -> int | None:
    found = [v for v in values if v is not None]
    return max(found) if found else None


def _budget_text(f: RankFacts) -> str:
    """The budget of rank ``f`` in words: its CPUs, whom they are shared with, and the bound."""
    sharing = [f"{f.local_ranks or 1} local rank{'s' if (f.local_ranks or 1) > 1 else ''}"]
    if f.peers > 1:
        sharing.append(f"{f.peers} pytest-xdist workers")
    text = f"rank {f.rank}'s host: {f.node_cpus} CPUs for {' x '.join(sharing)}, {f.cpus} each"
    if f.budget > f.cpus:
        text += (
            f"; its workers keep {f.cpu_used / max(1, f.workers):.2f} CPUs busy each, so up to "
            f"{OVERSUBSCRIBE} per CPU"
        )
    return text
