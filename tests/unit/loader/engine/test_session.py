"""The worker lifecycle and the order workers are served in (no processes)."""

from __future__ import annotations

import pytest

from loader.engine._order import choose_worker
from loader.engine._session import Aborting, Idle, Running, Stopped, WorkerState
from workers import Shard


def test_round_robin_starts_at_the_cursor_and_wraps() -> None:
    assert choose_worker(0, [True, True, True], [True, True, True]) == 0
    assert choose_worker(2, [True, True, True], [True, True, True]) == 2
    assert choose_worker(2, [True, False, False], [True, False, False]) == 0


def test_a_running_worker_is_waited_for_even_with_nothing_queued() -> None:
    # worker 1's turn: it has nothing yet but its epoch is not over, so the trainer waits for it
    # (taking worker 2's ready batch instead would make the order depend on timing)
    assert choose_worker(1, [False, False, True], [True, True, True]) == 1


def test_workers_whose_epoch_ended_and_drained_are_skipped() -> None:
    assert choose_worker(0, [False, False, True], [False, False, False]) == 2
    assert choose_worker(1, [False, True, False], [False, False, False]) == 1


def test_the_epoch_is_over_when_every_worker_ended_and_drained() -> None:
    assert choose_worker(0, [False, False], [False, False]) is None
    assert choose_worker(0, [], []) is None


@pytest.mark.parametrize("count", [1, 2, 5])
def test_a_full_epoch_comes_in_strict_rotation(count: int) -> None:
    queued = [3] * count
    order = []
    cursor = 0
    while (index := choose_worker(cursor, [q > 0 for q in queued], [False] * count)) is not None:
        order.append(index)
        queued[index] -= 1
        cursor = (index + 1) % count
    assert order == list(range(count)) * 3


class _Handle:
    index = 0
    shard = Shard.make(rank=0, world_size=1, worker=0, num_workers=1, seed=0)

    class spec:
        num_slots = 2

    def describe(self) -> str:
        return "worker 0"


def test_lifecycle_allows_only_the_documented_transitions() -> None:
    from loader.engine._session import WorkerSession

    session = WorkerSession(_Handle())  # type: ignore[arg-type]
    assert session.state == WorkerState.STARTING
    session.go(Idle(0), up=True)
    with pytest.raises(AssertionError, match=r"READY.*ENDED"):
        session.go(Running(0, ended=True))
    session.go(Running(0))
    assert session.state == WorkerState.RUNNING
    assert session.open_in_epoch and session.view().epoch == 0
    session.go(Running(0, ended=True))
    assert session.state == WorkerState.ENDED and not session.open_in_epoch
    session.go(Running(1))
    session.go(Aborting(1))
    with pytest.raises(AssertionError):
        session.go(Running(2))  # an aborting worker must rebuild first
    session.go(Idle(2))
    assert session.state == WorkerState.READY
    session.replaced(_Handle(), Idle(2), 0)  # type: ignore[arg-type]  # a new process
    assert session.state == WorkerState.STARTING
    session.go(Running(2))  # a command to a starting process: it runs the epoch once up
    assert session.state == WorkerState.STARTING and session.open_in_epoch
    session.go(Running(2), up=True)  # ... and goes on with its epoch
    assert session.state == WorkerState.RUNNING
    session.go(Stopped(failed=True))  # from anywhere
    assert session.state == WorkerState.FAILED
    with pytest.raises(AssertionError):
        session.go(Idle(3))
    session.reader.close()


def test_the_epoch_a_worker_starts_next_without_a_seek() -> None:
    """What set_epoch compares with: a new worker starts the epoch its sources were built for
    (a new layout's, later than 0); one that runs, ended or aborts an epoch, the next; one that
    seeks, the position's."""
    from ipc.wire import Position
    from loader.engine._session import Seeking, WorkerSession

    class Later(_Handle):
        shard = _Handle.shard.for_epoch(3)

    assert WorkerSession(_Handle()).next_epoch == 0  # type: ignore[arg-type]
    session = WorkerSession(Later())  # type: ignore[arg-type]
    assert session.next_epoch == 3
    session.go(Idle(3), up=True)
    session.go(Running(3))
    assert session.next_epoch == 4
    session.go(Running(3, ended=True))
    assert session.next_epoch == 4
    session.go(Seeking(Position(7, ())))
    assert session.next_epoch == 7
    session.go(Idle(7, Position(7, ())))
    session.go(Running(7))
    session.go(Aborting(7))
    assert session.next_epoch == 8
    session.go(Stopped(failed=False))
    assert session.next_epoch is None
