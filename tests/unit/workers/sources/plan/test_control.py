"""The worker's control state (``workers.sources.plan._control``): the samples known to fail,
the batches in flight."""

from __future__ import annotations

import threading

import pytest

from workers.sources.plan import (
    SKIP_DAMAGED,
    STARTED_TOGETHER,
    FedBatch,
    FeedState,
    OpenedOnce,
    SampleControl,
)


def test_bad_samples_grow_as_snapshots_written_by_one_thread() -> None:
    control = SampleControl("skip", bad=[3])
    assert control.skip and control.bad == {3}
    before = control.bad
    control.add_bad([3, 5])
    assert control.bad == {3, 5} and before == {3}  # (an earlier snapshot is not changed)
    assert not SampleControl().skip
    failed: list[BaseException] = []

    def elsewhere() -> None:
        try:
            control.add_bad([7])
        except AssertionError as error:
            failed.append(error)

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert failed and control.bad == {3, 5}


def test_batches_in_flight_are_delivered_oldest_first() -> None:
    state = FeedState()
    assert state.delivered() is None and not state.continuous
    state.set_continuous(True)
    assert state.continuous
    for step in range(3):
        state.fed(FedBatch(epoch=1, step=step, padded=0))
    assert state.find(1, 2) == FedBatch(1, 2, 0)
    assert state.find(2, 0) is None
    first = state.delivered()
    assert first is not None and first.step == 0
    assert state.find(1, 0) is None  # (delivered: no longer in flight)


def test_a_fed_batch_is_a_frozen_record() -> None:
    batch = FedBatch(0, 4, padded=2, replaced=(1,), skipped=(9,))
    with pytest.raises(AttributeError):
        batch.step = 5  # type: ignore[misc]


def test_what_a_worker_opened_is_kept_for_the_same_arguments_only() -> None:
    opened: list[int] = []

    def open_it() -> int:
        opened.append(len(opened))
        return opened[-1]

    once: OpenedOnce[int] = OpenedOnce()
    assert once.get(("a",), {}, open_it) == 0  # outside a worker: opened every time
    assert once.get(("a",), {}, open_it) == 1
    token = STARTED_TOGETHER.set("pool-1")
    try:
        first = once.get(("a",), {"anon": True}, open_it)
        assert once.get(("a",), {"anon": True}, open_it) == first  # kept
        assert once.get(("b",), {"anon": True}, open_it) == first + 1  # other arguments
        assert once.get(("b",), {"anon": False}, open_it) == first + 2  # other options
        assert once.get(("b",), {"x": object()}, open_it) == first + 3  # not JSON: every time
        assert once.get(("b",), {"x": object()}, open_it) == first + 4
        skipping = SKIP_DAMAGED.set(True)
        try:
            assert once.get(("a",), {}, open_it) == first + 5
            assert once.get(("a",), {}, open_it) == first + 5
        finally:
            SKIP_DAMAGED.reset(skipping)
        assert once.get(("a",), {}, open_it) == first + 6  # on_error differs: opened again
    finally:
        STARTED_TOGETHER.reset(token)
