"""The coordinator (:mod:`loader.engine._coordinator`) over workers played by threads
(:mod:`.played`): real records on real control channels, real slots, no process."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import numpy as np
import pytest

from ipc.wire import Position, Sampling
from loader.engine._coordinator import Coordinator
from loader.engine._healing import Healing, Timeouts
from loader.engine._session import Delivery, WorkerState
from loader.engine._stats import Timeline
from loader.errors import SlotsExhaustedError, StartupError, WorkerDiedError

from .fakes import FakeSpec, shard
from .played import PlayedPool, Script, ids


def _coordinator(
    script: Script | None = None, *, workers: int = 2, num_slots: int = 3, max_restarts: int = 0
) -> Coordinator:
    specs = [FakeSpec(shard(i, workers), num_slots) for i in range(workers)]
    healing = Healing(
        max_restarts=max_restarts,
        on_error="raise",
        max_skipped=None,
        timeouts=Timeouts(10.0, 10.0, 10.0),
    )
    return Coordinator(PlayedPool(specs, script=script), healing, timeline=Timeline(workers))


@pytest.fixture
def started() -> Iterator[Coordinator]:
    coordinator = _coordinator()
    coordinator.start(10.0)
    yield coordinator
    coordinator.close()


def _take(coordinator: Coordinator, step: int) -> tuple[int, list[int]] | None:
    """The next batch handed out as a private copy (its slot back at once, as with
    ``copy=True``): (worker, its ids); None at the epoch's end."""
    delivery = coordinator.next_batch(step)
    if delivery is None:
        return None
    assert delivery.info.step == step
    values = [int(v) for v in np.asarray(delivery.arrays[0])]
    coordinator.handed_out(delivery)
    worker, reader, descriptor = delivery.info.worker, delivery.reader, delivery.descriptor
    del delivery
    coordinator.release_at_once(worker, reader, descriptor)
    return worker, values


def _epoch(coordinator: Coordinator, first_step: int = 0) -> list[tuple[int, list[int]]]:
    got = []
    while (taken := _take(coordinator, first_step + len(got))) is not None:
        got.append(taken)
    return got


def _undisturbed(epoch: int, workers: int = 2, steps: int = 4) -> list[tuple[int, list[int]]]:
    return [(w, ids(w, s, epoch, 2, steps)) for s in range(steps) for w in range(workers)]


def test_start_waits_for_every_worker_and_knows_what_they_sample(started: Coordinator) -> None:
    assert all(s.up for s in started.sessions)
    assert started.sampling() == Sampling(16, 2, 0, False, False, "played")
    assert started.steps_per_epoch() == 8
    assert started.next_epoch() == 0
    assert [
        name.startswith(f"worker {i} (shard {i}/2") for i, name in enumerate(started.worker_names())
    ] == [True, True]


def test_an_epoch_comes_round_robin_and_its_slots_go_back(started: Coordinator) -> None:
    started.start_epoch(0)
    started.wait_signatures()
    # 3 slots a worker and 4 batches each: the epoch ends only if dropped batches are released
    assert _epoch(started) == _undisturbed(0)
    assert started.delivered() == [4, 4]
    assert started.next_epoch() == 1
    assert started.agreement_fields() is not None and started.output_kind(0) == "dict"
    started.start_epoch(1)  # the next epoch, without a seek
    assert _epoch(started) == _undisturbed(1)


def test_a_trainer_holding_every_slot_is_told_and_the_pool_closes() -> None:
    coordinator = _coordinator(num_slots=2)
    coordinator.start(10.0)
    coordinator.start_epoch(0)
    held: list[Delivery] = []
    with pytest.raises(SlotsExhaustedError, match="holds all 2 shared-memory slots"):
        for step in range(8):
            delivery = coordinator.next_batch(step)
            assert delivery is not None
            held.append(delivery)
    assert len(held) == 4  # two of each worker, then the third of worker 0 cannot be made
    assert coordinator.pool.closed and coordinator.failure is not None
    assert all(s.state is WorkerState.FAILED for s in coordinator.sessions)
    del held
    gc.collect()


def test_leaving_an_epoch_early_readies_every_worker_for_the_next(started: Coordinator) -> None:
    started.start_epoch(0)
    assert [_take(started, step) for step in range(3)] == _undisturbed(0)[:3]
    started.abort_epoch(0)
    assert all(s.state is WorkerState.READY for s in started.sessions)
    assert started.next_epoch() == 1
    pool = started.pool
    assert isinstance(pool, PlayedPool)
    assert all(any(type(c).__name__ == "AbortEpoch" for c in w.commands) for w in pool.handles)
    started.start_epoch(1)
    assert _epoch(started) == _undisturbed(1)


def test_a_seek_starts_each_worker_after_what_its_shard_received(started: Coordinator) -> None:
    left = started.seek(Position(0, ((1, (3, 1)),), continues=True))
    assert left == [1, 3]
    started.start_epoch(0, [3, 1], cursor=1)
    got = _epoch(started, first_step=4)
    assert got[0] == (1, ids(1, 1, 0, 2, 4))  # the cursor's worker first
    assert sorted(got) == sorted(
        [(0, ids(0, 3, 0, 2, 4))] + [(1, ids(1, s, 0, 2, 4)) for s in (1, 2, 3)]
    )


def test_a_dead_worker_is_replaced_and_the_epoch_goes_on_in_order() -> None:
    died: list[int] = []

    def die_once(worker: int, epoch: int, step: int) -> bool:
        if (worker, step) == (0, 2) and not died:
            died.append(step)
            return False
        return True

    coordinator = _coordinator(Script(before_batch=die_once), max_restarts=1)
    coordinator.start(10.0)
    try:
        coordinator.start_epoch(0)
        assert _epoch(coordinator) == _undisturbed(0)
        assert coordinator.healing.restarts == 1
        pool = coordinator.pool
        assert isinstance(pool, PlayedPool) and len(pool.retired) == 1
        assert pool.retired[0].process.exitcode == -9
    finally:
        coordinator.close()


def test_a_dead_worker_without_a_restart_budget_fails_and_closes_the_pool() -> None:
    coordinator = _coordinator(Script(before_batch=lambda w, e, s: (w, s) != (1, 1)))
    coordinator.start(10.0)
    coordinator.start_epoch(0)
    with pytest.raises(WorkerDiedError):
        _epoch(coordinator)
    assert coordinator.pool.closed
    assert "worker 1" in coordinator.failure_reason or "worker 1" in str(coordinator.failure)
    assert coordinator.next_epoch() == 1  # as the workers stood when they stopped


def test_a_worker_silent_past_the_startup_timeout_fails_the_start() -> None:
    coordinator = _coordinator(Script(silent=True))
    with pytest.raises(StartupError):
        coordinator.start(0.3)
    assert coordinator.pool.closed and coordinator.failure is not None
