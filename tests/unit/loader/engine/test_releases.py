"""When a batch's slot goes back to its worker (:mod:`loader.engine._releases`), over real
sessions and slot readers whose regions hold no memory."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ipc import wire
from loader.engine._releases import Releases

from .fakes import arrive, batch, running


@pytest.fixture
def releases() -> Iterator[Releases]:
    made = Releases()
    yield made
    made.close()  # (its wakeup pipe)


def _deliver_all(session):  # type: ignore[no-untyped-def]
    return [session.deliver(step).descriptor for step in range(session.queued)]


def test_lazy_releases_wait_for_half_a_ring(releases: Releases) -> None:
    session = running(0, 1, num_slots=4)
    arrive(session, 3)
    first, second, _ = _deliver_all(session)
    releases.queue.put(session.reader, first.slot, first.generation)
    assert releases.due([session], lazy=True) == []  # 1 < half of 4, and it has a free slot
    releases.queue.put(session.reader, second.slot, second.generation)
    assert releases.due([session], lazy=True) == [
        (0, wire.Release(((first.slot, first.generation), (second.slot, second.generation))))
    ]


def test_a_release_the_worker_needs_is_never_held_back(releases: Releases) -> None:
    session = running(0, 1, num_slots=4)
    arrive(session, 4)  # every slot held
    first, *_ = _deliver_all(session)
    releases.queue.put(session.reader, first.slot, first.generation)
    assert releases.due([session], lazy=True) == [(0, wire.Release(((0, 1),)))]


def test_eager_releases_go_at_once_and_only_once(releases: Releases) -> None:
    session = running(0, 1, num_slots=4)
    arrive(session)
    (first,) = _deliver_all(session)
    releases.queue.put(session.reader, first.slot, first.generation)
    releases.queue.put(session.reader, first.slot, first.generation)  # (a duplicate)
    assert releases.due([session], lazy=False) == [(0, wire.Release(((0, 1),)))]
    assert releases.due([session], lazy=False) == []
    assert Releases.now(session.reader, first) is None  # released already


def test_a_replaced_processs_releases_are_dropped(releases: Releases) -> None:
    session = running(0, 1, num_slots=4)
    arrive(session)
    (first,) = _deliver_all(session)
    old = session.reader
    session.drop_process()
    session.replaced(session.handle, session.view().target, 0)
    releases.queue.put(old, first.slot, first.generation)
    assert releases.due([session], lazy=False) == []


def test_a_dropped_batch_goes_back_at_once() -> None:
    session = running(0, 1, num_slots=2)
    arrive(session)
    (dropped,) = session.take_queued()
    assert Releases.now(session.reader, dropped) == wire.Release(((0, 1),))
    assert session.reader.held == 0
    assert Releases.now(session.reader, batch(5, slot=1)) is None  # never held
