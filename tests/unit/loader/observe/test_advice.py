"""The advice of ``loader.diagnose()`` as a policy (no processes): tables of (host CPUs, local
ranks, measured stage times) in, the settings every rank shares out, within the host's CPUs
and the same for every rank."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from loader.config._env import local_ranks, node_shares, worker_budget
from loader.engine._stats import LoaderStats, TrainerTimes
from loader.observe._advice import JobAdvice, RankFacts, agree, source_kind, wish
from loader.observe._diagnose import report


def facts(
    rank: int = 0,
    *,
    cpus: int,
    local: int | None,
    waiting: float,
    stage: str,
    share: float,
    cpu: float,
    workers: int = 2,
    load_cpu: float | None = None,
    host: str = "node",
    source: str = "",
    window: int | None = None,
) -> RankFacts:
    """One rank's window: ``share`` of the workers' time in ``stage``, ``cpu`` CPUs busy."""
    fractions = {s: 0.0 for s in ("load", "dali", "blocked", "publish", "idle")}
    fractions[stage] = share
    return RankFacts(
        rank=rank,
        workers=workers,
        threads=1,
        prefetch=2,
        batches=200,
        window=10.0,
        waiting=waiting,
        fractions=fractions,
        cpu_used=cpu,
        node_cpus=cpus,
        load_cpu=load_cpu,
        local_ranks=local,
        host=host,
        source=source,
        shuffle_window=window,
    )


def io(rank: int, cpus: int, local: int | None, waiting: float, **kw: Any) -> RankFacts:
    """Workers that wait on storage: load() dominates and is on CPU 5% of its time."""
    return facts(
        rank,
        cpus=cpus,
        local=local,
        waiting=waiting,
        stage="load",
        share=0.9,
        cpu=0.1,
        load_cpu=0.05,
        **kw,
    )


def dali(rank: int, cpus: int, local: int | None, waiting: float, cpu: float) -> RankFacts:
    """Workers busy in DALI, keeping ``cpu`` CPUs busy."""
    return facts(rank, cpus=cpus, local=local, waiting=waiting, stage="dali", share=0.9, cpu=cpu)


def idle(rank: int, cpus: int, local: int | None) -> RankFacts:
    """A rank that does not wait: its workers are blocked on full slots."""
    return facts(rank, cpus=cpus, local=local, waiting=0.01, stage="blocked", share=0.8, cpu=0.2)


# (CPUs, local ranks, per-worker CPU) -> the most workers a rank may run
BUDGETS = [
    (2, 1, 1.0, 2),  # busy workers: one per CPU
    (2, 1, 0.05, 4),  # workers that wait: up to 2 per CPU
    (2, 2, 0.05, 2),  # 2 CPUs for 2 local ranks: 1 CPU each, 2 waiting workers on it
    (2, 2, 1.0, 1),
    (8, 2, 0.5, 8),  # half a CPU each: 8 fit on the 4 CPUs of this rank
    (8, 2, 0.8, 5),
    (64, 8, 0.02, 16),
]


@pytest.mark.parametrize(("cpus", "local", "per_worker", "expected"), BUDGETS)
def test_a_ranks_budget_is_its_share_of_the_hosts_cpus(
    cpus: int, local: int, per_worker: float, expected: int
) -> None:
    share = max(1, cpus // local)
    assert worker_budget(share, per_worker) == expected
    rank = facts(cpus=cpus, local=local, waiting=0.5, stage="dali", share=0.9, cpu=2 * per_worker)
    assert rank.cpus == share and rank.budget == expected


# (the ranks' figures) -> num_workers advised on every rank (None: keep it)
TABLE = [
    # one rank, 2 CPUs, workers waiting on storage: more workers, up to 2 per CPU
    ([io(0, 2, 1, 0.5)], 4),
    # 2 local ranks on 8 CPUs (4 each): rank 0 alone would ask for 5, rank 1 for 16; the job
    # takes the larger, within the budget of 8
    ([io(0, 8, 2, 0.6), io(1, 8, 2, 0.875)], 8),
    # the case: 2 CPUs for 2 local ranks, both waiting: 2 per rank is already the most
    ([io(0, 2, 2, 0.6), io(1, 2, 2, 0.95)], None),
    # DALI on the CPU with CPUs idle: as many as the wait needs (4), within the CPUs (8 fit)
    ([dali(0, 4, 1, 0.4, cpu=1.0)], 4),
    # the same workers, 4 local ranks on 4 CPUs: each rank's one CPU is saturated: none
    ([dali(0, 4, 4, 0.4, cpu=1.0)], None),
    # rank 1 saturated and waiting: more workers would not speed it up, so none for rank 0
    ([io(0, 8, 2, 0.5), dali(1, 8, 2, 0.3, cpu=3.8)], None),
    # rank 1 keeps up: rank 0's need decides
    ([dali(0, 8, 2, 0.5, cpu=1.0), idle(1, 8, 2)], 4),
    # nobody waits: nothing to change
    ([idle(0, 8, 2), idle(1, 8, 2)], None),
    # LOCAL_WORLD_SIZE unknown: the ranks on one host share it (2 on "a": 2 CPUs each)
    ([io(0, 4, None, 0.9, host="a"), io(1, 4, None, 0.9, host="a")], 4),
    # ... and a rank alone on its host has all of them: the smallest budget of any rank wins
    ([io(0, 4, None, 0.9, host="a"), io(1, 4, None, 0.9, host="b")], 8),
    (
        [
            io(0, 4, None, 0.9, host="a"),
            io(1, 4, None, 0.9, host="a"),
            io(2, 4, None, 0.9, host="b"),
        ],
        4,
    ),
]


@pytest.mark.parametrize(("ranks", "expected"), TABLE)
def test_the_worker_count_is_agreed_and_within_every_hosts_cpus(
    ranks: list[RankFacts], expected: int | None
) -> None:
    job = agree(ranks)
    assert job.num_workers == expected, job.reason
    # every rank computes it from the same gathered list: the same advice whatever the order
    # a rank looks at it from, and never more workers than any rank's budget allows
    assert agree(list(ranks)) == job
    if expected is not None:
        assert all(expected <= r.budget for r in agree_resolved(ranks))
        assert all(expected * (r.local_ranks or 1) <= 2 * r.node_cpus for r in resolved(ranks))
        assert f"num_workers={expected}" in str(job)
    assert len(job.ranks) == len(ranks)


def resolved(ranks: list[RankFacts]) -> list[RankFacts]:
    hosts = [r.host for r in ranks]
    return [
        r if r.local_ranks is not None else replace(r, local_ranks=local_ranks(hosts, i, None))
        for i, r in enumerate(ranks)
    ]


agree_resolved = resolved


def test_a_rank_alone_would_advise_otherwise_than_the_job() -> None:
    """The issue's symptom: each rank's own figures ask for different counts (5 and 16)."""
    ranks = [io(0, 8, 2, 0.6), io(1, 8, 2, 0.875)]
    assert [wish(r).workers for r in ranks] == [5, 16]
    assert agree(ranks).num_workers == 8
    assert "rank 1" in agree(ranks).reason and "budget of 8" in agree(ranks).reason


def test_the_reasons_say_what_limits_the_count() -> None:
    full = agree([io(0, 2, 2, 0.6), io(1, 2, 2, 0.95)])
    assert "already the most the CPUs allow" in full.reason
    assert "2 CPUs for 2 local ranks" in full.reason
    vetoed = agree([io(0, 8, 2, 0.5), dali(1, 8, 2, 0.3, cpu=3.8)])
    assert "rank 1 waits for its workers" in vetoed.reason
    assert "slowest rank" in vetoed.reason
    assert agree([idle(0, 8, 2)]) == JobAdvice(budget=8, ranks=(agree([idle(0, 8, 2)]).ranks))
    assert str(agree([idle(0, 8, 2)])) == "keep the settings"


def test_shared_settings_other_than_workers() -> None:
    job = agree([dali(0, 4, 1, 0.4, cpu=1.0), dali(1, 4, 1, 0.2, cpu=1.0)])
    assert job.num_threads == 2
    blocked = facts(cpus=4, local=1, waiting=0.4, stage="blocked", share=0.6, cpu=0.5)
    assert agree([blocked]).prefetch == 4


def test_tar_sources_are_told_about_ahead_and_shuffle_window() -> None:
    assert source_kind("tars:0123456789abcdef+window4") == ("sharded_tars", 4)
    assert source_kind("tars:0123456789abcdef") == ("sharded_tars", None)
    assert source_kind("files:0123") == ("sharded_files", None)
    assert source_kind("mix:0123") == ("sharded_mix", None)
    # Parquet files, and a datasets.Dataset's Arrow files (they were named sharded_source)
    assert source_kind("parquet:0123456789abcdef+window5") == ("sharded_parquet", None)
    assert source_kind("hf-dataset:ab:0123456789ab") == ("sharded_parquet", None)
    assert source_kind("my-dataset-v2") == ("sharded_source", None)
    assert source_kind("") == ("sharded_source", None)
    assert source_kind(None) == ("", None)
    windowed = [io(r, 8, 2, 0.7, source="sharded_tars", window=4) for r in range(2)]
    assert agree(windowed).ahead == 4  # the next group of 4 shards fetched whole
    assert agree([io(0, 8, 2, 0.7, source="sharded_tars")]).ahead == 3
    assert agree([io(0, 8, 2, 0.7)]).ahead is None  # not a tar source
    text = report(windowed[0], agree(windowed), _stats(), (0.5, 8)).suggestion
    assert "sharded_tars(..., ahead=4)" in text and "shuffle_window" in text
    assert "4 + 4 shards" in text and "32 shards on this host" in text
    assert "num_workers=7" in text  # (2 / (1 - 0.7) would stop the wait)


def _stats() -> LoaderStats:
    trainer = TrainerTimes(200, 5.0, 0.0, 5.0)
    return LoaderStats((), 200, 0, 0, 0.0, 0, (), 0, 1.0, 10.0, 0.1, trainer, trainer, 10.0)


def test_every_ranks_report_names_the_same_worker_count() -> None:
    """Rank 0 is input-bound, rank 1 not: their verdicts differ, their worker count does not."""
    ranks = [dali(0, 8, 2, 0.5, cpu=1.0), idle(1, 8, 2)]
    job = agree(ranks)
    reports = [report(r, job, _stats(), (0.5, 8), world_size=2) for r in ranks]
    assert reports[0].input_bound and not reports[1].input_bound
    for made in reports:
        assert "num_workers=4" in made.suggestion
        assert "num_workers=3" not in made.suggestion and "num_workers=5" not in made.suggestion
        text = str(made)
        assert "  every rank: num_workers=4" in text
        assert "  rank 0" in text and "  rank 1" in text
    assert "rank 1 (this rank): not input-bound" in str(reports[1])


def test_host_shares_from_gathered_host_facts() -> None:
    gathered = [
        {"host": "a", "node_cpus": 8, "local_world_size": None, "peers": 1},
        {"host": "a", "node_cpus": 8, "local_world_size": None, "peers": 1},
        {"host": "b", "node_cpus": 8, "local_world_size": None, "peers": 1},
        {"host": "c", "node_cpus": 8, "local_world_size": 4, "peers": 1},
    ]
    assert node_shares(gathered) == [4, 4, 8, 2]
    assert local_ranks(["a", "a", "b"], 2, None) == 1
    assert local_ranks(["a", "a", "b"], 2, 3) == 3
