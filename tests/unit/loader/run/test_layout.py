"""The layout plan (:mod:`loader.run._layout`) beyond its first guess: the rank a process group
settles, the autotuner's decisions at the start and after an epoch, and a state's own layout.
No worker: the plan decides and starts nothing."""

from __future__ import annotations

import dataclasses
import inspect
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from loader import Loader
from loader.config import SETTLED_EVERY, LoaderConfig
from loader.engine import Timeline, WorkerFacts
from loader.run._layout import LayoutPlan
from tests import timing_pipelines as T
from tests.unit.loader.engine.conftest import _no_process_started  # noqa: F401 (autouse)

MIB = 2**20


def _config(**arguments: Any) -> LoaderConfig:
    defaults = {
        name: parameter.default
        for name, parameter in inspect.signature(Loader.__init__).parameters.items()
        if parameter.default is not inspect.Parameter.empty
    }
    return LoaderConfig.build(
        T.quick_source, T.id_step, **{**defaults, "batch_size": 4, **arguments}
    )


def _auto(memory_limit: int = 1024 * MIB) -> LayoutPlan:
    """num_workers="auto" on 8 CPUs (whatever this machine has): the first guess, 2 workers."""
    config = dataclasses.replace(_config(num_workers="auto", memory_limit=memory_limit), cpus=8)
    plan = LayoutPlan(config)
    assert plan.config.num_workers == 2 and plan.autotuner is not None
    return plan


class _Workers:
    """What the plan asks of the running workers after an epoch (their facts), counted."""

    def __init__(self, facts: tuple[WorkerFacts, ...]) -> None:
        self.facts, self.asked = facts, 0

    def worker_facts(self) -> tuple[WorkerFacts, ...]:
        self.asked += 1
        return self.facts


def _epoch_on(timeline: Timeline, epoch: int, batches: int = 40) -> None:
    """``batches`` next() calls of ``epoch``, 10 ms apart."""
    start = time.perf_counter_ns()
    for step in range(batches):
        at = start + step * 10_000_000
        timeline.next_call(at, 0, epoch, step // 2, step % 2, left_ns=at + 1_000_000)


def test_workers_over_the_memory_budget_at_start_are_started_again_fewer() -> None:
    plan = _auto(memory_limit=64 * MIB)
    heavy = (WorkerFacts(None, 40 * MIB, 1), WorkerFacts(None, 40 * MIB, 1))
    fitted = plan.fit_memory(heavy)
    assert fitted is not None and fitted.num_workers == 1 and plan.config is fitted
    light = _auto()
    assert light.fit_memory((WorkerFacts(None, 1024, 1),) * 2) is None
    assert light.config.num_workers == 2


def test_an_epoch_over_the_memory_budget_moves_the_next_one_to_fewer_workers() -> None:
    plan = _auto(memory_limit=64 * MIB)
    running = plan.config
    timeline = Timeline(2)
    _epoch_on(timeline, 0)
    workers = _Workers((WorkerFacts(None, 40 * MIB, 1), WorkerFacts(None, 40 * MIB, 1)))
    plan.after_epoch(timeline, workers, 0)  # type: ignore[arg-type]
    assert workers.asked == 1
    # decided, not applied: the running layout stays until the next epoch's start
    assert plan.config is running
    assert plan.planned(1, live=True).num_workers == 2
    assert plan.planned(1, live=False).num_workers == 1
    layout = plan.next_epoch(1, started=True, loaded_for=None)
    assert (layout.relay, layout.config.num_workers, layout.settled.num_workers) == (False, 1, 2)
    assert layout.config.first_epoch == 1 and plan.config is layout.config
    again = plan.next_epoch(2, started=True, loaded_for=None)  # applied once
    assert again.config is again.settled is plan.config


def test_a_settled_layout_is_checked_only_every_few_epochs() -> None:
    plan = _auto()
    assert plan.autotuner is not None
    plan.autotuner.settled = True
    workers = _Workers(())
    plan.after_epoch(Timeline(2), workers, 1)  # type: ignore[arg-type]
    assert workers.asked == 0
    fixed = LayoutPlan(_config(num_workers=2))
    fixed.after_epoch(Timeline(2), workers, SETTLED_EVERY)  # type: ignore[arg-type]
    assert workers.asked == 0 and fixed.report() is None


def test_a_state_resumes_on_the_number_of_workers_it_was_saved_with() -> None:
    plan = _auto()
    saved = {"layout": {"world_size": 1, "num_workers": 4}}
    plan.resume_on(saved, live=True)  # not while an epoch is live
    assert plan.planned(0, live=False).num_workers == 2
    plan.resume_on({"layout": {"world_size": 2, "num_workers": 4}}, live=False)  # another world
    assert plan.planned(0, live=False).num_workers == 2
    plan.resume_on(saved, live=False)
    assert plan.planned(0, live=False).num_workers == 4
    report = plan.report()
    assert report is not None and "the layout of the state resumed from" in report.reason
    fixed = LayoutPlan(_config(num_workers=3))
    fixed.resume_on(saved, live=False)  # a fixed number of workers stays
    assert fixed.planned(0, live=False).num_workers == 3


@pytest.fixture
def launcher_rank(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A launcher's WORLD_SIZE without RANK (Lightning's DDP): a provisional rank 1 of 2."""
    for name in ("RANK", "LOCAL_WORLD_SIZE", "NODE_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    yield


@pytest.fixture
def group(tmp_path: Path) -> Iterator[Callable[[], None]]:
    """Sets up a torch.distributed group of this one process (gloo, in-process: rank 0 of 1)
    when called, after the loader was built."""
    dist = pytest.importorskip("torch.distributed")

    def start() -> None:
        path = tmp_path / "group"
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_provisional_rank_waits_for_the_process_group(launcher_rank: None) -> None:
    plan = LayoutPlan(_config(num_workers=2))
    assert (plan.config.rank, plan.config.world_size) == (1, 2)
    assert plan.planned(0, live=False, strict=False) is plan.config
    with pytest.raises(ValueError, match=r"no torch\.distributed process group"):
        plan.planned(0, live=False)


def test_the_process_group_settles_the_rank_at_the_first_epoch(
    launcher_rank: None, group: Callable[[], None]
) -> None:
    plan = LayoutPlan(_config(num_workers=2))  # built before the group: rank 1 of 2 for now
    built = plan.config
    group()
    assert plan.planned(0, live=False).rank == 0  # a query shows the rank to come
    assert plan.config is built
    layout = plan.next_epoch(0, started=False, loaded_for=None)
    assert layout.relay and (layout.settled.rank, layout.settled.world_size) == (0, 1)
    assert plan.config is layout.config is layout.settled


def test_a_rank_that_moves_after_an_epoch_or_a_loaded_state_is_refused(
    launcher_rank: None, group: Callable[[], None]
) -> None:
    ran, loaded = LayoutPlan(_config(num_workers=2)), LayoutPlan(_config(num_workers=2))
    group()
    with pytest.raises(RuntimeError, match="already ran or resumed an epoch as rank 1 of 2"):
        ran.next_epoch(1, started=True, loaded_for=None)
    with pytest.raises(RuntimeError, match="a state was loaded while this loader was rank 1"):
        loaded.next_epoch(0, started=False, loaded_for=(1, 2))
