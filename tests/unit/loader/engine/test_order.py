"""Which worker the trainer serves next (:mod:`loader.engine._order`), over real sessions whose
processes are stand-ins."""

from __future__ import annotations

import subprocess
import sys

from ipc import wire
from loader.engine._order import ArrivalOrder, InOrder, Take, Wait
from loader.engine._session import WorkerSession

from . import conftest
from .fakes import arrive, running


def _end(session: WorkerSession) -> None:
    session.on_epoch_end(wire.EpochEnd(0, 0, 0, 0))


def test_the_engine_tests_import_no_dali() -> None:
    """Importing the engine's modules (every one, through the coordinator) imports no DALI: in
    a fresh interpreter, so that what other tests of this process imported does not count."""
    assert conftest.DALI_FROM_ENGINE is not True, "importing loader.engine imported DALI"
    script = (
        "import sys, loader.engine._coordinator, loader.engine._order, loader.engine._session\n"
        "assert 'nvidia.dali' not in sys.modules, sorted(m for m in sys.modules if 'dali' in m)"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_in_order_takes_turns_from_the_cursor() -> None:
    sessions = [running(i, 3) for i in range(3)]
    for session in sessions:
        arrive(session, 2)
    order = InOrder()
    order.start(1)
    taken = []
    for _ in range(6):
        decision = order.choose(sessions)
        assert isinstance(decision, Take)
        taken.append(decision.worker)
        sessions[decision.worker].deliver(0)
    assert taken == [1, 2, 0, 1, 2, 0]


def test_in_order_waits_for_the_worker_whose_turn_it_is() -> None:
    """A batch of another worker is ready, but the order must not depend on timing."""
    first, second = running(0), running(1)
    arrive(second)
    assert InOrder().choose([first, second]) == Wait(0, (0,))


def test_in_order_skips_a_worker_whose_epoch_ended_and_drained() -> None:
    first, second = running(0), running(1)
    _end(first)
    arrive(second)
    order = InOrder()
    assert order.choose([first, second]) == Take(1)
    assert order.cursor == 0  # past worker 1, wrapping
    second.deliver(0)
    assert order.choose([first, second]) == Wait(1, (1,))
    _end(second)
    assert order.choose([first, second]) is None  # every epoch over and drained


def test_in_order_still_takes_the_queued_batches_of_an_ended_worker() -> None:
    first, second = running(0), running(1)
    arrive(first)
    _end(first)
    _end(second)
    assert InOrder().choose([first, second]) == Take(0)


def test_arrival_order_takes_batches_as_they_arrived() -> None:
    first, second = running(0), running(1)
    order = ArrivalOrder()
    arrive(second)
    order.arrived(1)
    arrive(first)
    order.arrived(0)
    assert order.choose([first, second]) == Take(1)
    second.deliver(0)
    assert order.choose([first, second]) == Take(0)


def test_arrival_order_skips_an_arrival_whose_queue_was_dropped() -> None:
    first, second = running(0), running(1)
    order = ArrivalOrder()
    arrive(first)
    order.arrived(0)
    arrive(second)
    order.arrived(1)
    first.take_queued()  # (a replaced worker's queue goes)
    assert order.choose([first, second]) == Take(1)


def test_arrival_order_waits_on_every_open_worker_naming_the_furthest_behind() -> None:
    first, second, third = running(0, 3), running(1, 3), running(2, 3)
    order = ArrivalOrder()
    arrive(first, 2)
    first.deliver(0), first.deliver(1)
    arrive(third)
    third.deliver(0)
    _end(third)
    assert order.choose([first, second, third]) == Wait(1, (0, 1))
    _end(first), _end(second)
    assert order.choose([first, second, third]) is None


def test_arrival_order_never_waits_while_a_batch_is_queued() -> None:
    first, second = running(0), running(1)
    arrive(second)  # arrived, but the order was not told (e.g. started after it)
    assert ArrivalOrder().choose([first, second]) == Take(1)
