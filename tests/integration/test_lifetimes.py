"""Dropping a Loader closes it at once, iterated or not: nothing in it refers back to it, so its
finalizer runs when the last reference goes, not when the cyclic garbage collector gets to it
(checked with the collector off). ``leak_check`` names a loader that a test left open, or that
was dropped in a reference cycle of the user's and so lived until the collector ran."""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loader import Loader
from loader.testing import Snapshot, loader_leaks, open_loaders, snapshot
from tests import pipelines as P
from tests.integration._jobs import alive

pytestmark = pytest.mark.timeout(120)


def make(workers: int = 2) -> Loader:
    return Loader(P.sample_source, P.cast_step, batch_size=4, num_workers=workers)


@pytest.fixture
def no_collector() -> Iterator[None]:
    """The cyclic garbage collector off: only reference counts free objects."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def released(before: Snapshot, pids: list[int], seconds: float = 5.0) -> list[str]:
    """What of a dropped loader is still there after up to ``seconds`` (without collecting
    garbage): its workers, new descriptors, new /dev/shm entries."""
    deadline = time.monotonic() + seconds
    while True:
        now = snapshot()
        left = []
        if alive(pids):
            left.append(f"workers alive: {alive(pids)}")
        if now.fds - before.fds:
            left.append(f"descriptors: {sorted(now.fds - before.fds)}")
        if now.shm - before.shm:
            left.append(f"/dev/shm: {sorted(now.shm - before.shm)}")
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


@pytest.mark.usefixtures("no_collector")
def test_a_loader_dropped_after_an_epoch_closes_at_once() -> None:
    before = snapshot()
    loader = make()
    batches = sum(1 for _ in loader)  # (each batch dropped before the next)
    assert batches == len(loader)
    pids = loader.worker_pids()
    assert alive(pids) == pids
    dropped = weakref.ref(loader)
    del loader
    assert dropped() is None, f"still referred to by {gc.get_referrers(dropped())}"
    assert released(before, pids) == []


@pytest.mark.usefixtures("no_collector")
def test_a_loader_dropped_mid_epoch_or_never_iterated_closes_at_once() -> None:
    before = snapshot()
    never, half = make(1), make()
    iterator = iter(half)
    next(iterator)  # (the batch is dropped at once)
    never_pids, half_pids = never.worker_pids(), half.worker_pids()
    del never
    del half  # the iterator keeps it alive
    assert alive(half_pids) == half_pids
    assert next(iterator).info.step == 1
    del iterator
    assert released(before, never_pids + half_pids) == []


@pytest.mark.usefixtures("no_collector")
def test_an_iterator_alone_keeps_its_loader() -> None:
    """``for batch in Loader(...)``: the loader lives as long as its iterator."""
    before = snapshot()
    iterator = iter(make())
    gc.collect()
    first = next(iterator)
    assert first.info.step == 0
    del first
    left = len(iterator)
    assert left > 0 and sum(1 for _ in iterator) == left
    del iterator
    assert released(before, []) == []


def test_leak_check_names_a_loader_dropped_in_a_users_cycle() -> None:
    """A loader held by an object that refers to itself is open until the collector runs: the
    check, given the loaders open before it collected, says so; and one still open."""

    class Holder:
        def __init__(self) -> None:
            self.loader = make(1)
            self.me: Any = self

    holder = Holder()
    pids = holder.loader.worker_pids()
    kept = make(1)
    known = weakref.WeakSet([kept])
    gc.disable()
    try:
        del holder
        noted = open_loaders(known)  # what the fixture notes before it collects garbage
        assert [entry.pids for entry in noted] == [tuple(pids)]
        assert alive(pids) == pids
    finally:
        gc.enable()
    problems = loader_leaks(noted)
    assert len(problems) == 1
    assert "dropped without close() while held in a reference cycle" in problems[0]
    assert str(pids[0]) in problems[0]
    assert alive(pids) == []  # the collector closed it
    still = open_loaders()
    assert [entry.pids for entry in still] == [tuple(kept.worker_pids())]
    (problem,) = loader_leaks(still)
    assert "still open after the test" in problem
    kept.close()
    assert loader_leaks(still) == [] and open_loaders() == []


def test_leak_check_fails_a_test_that_leaves_a_loader_in_a_cycle(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fixture itself, in a pytest run of its own: a loader closed, or dropped outside a
    cycle, passes; one dropped in a cycle fails the test at teardown."""
    pytester.makepyfile(
        """
        import gc
        import tests.pipelines as P
        from loader import Loader

        def test_clean(leak_check):
            with Loader(P.sample_source, P.cast_step, batch_size=4, num_workers=1) as loader:
                sum(1 for _ in loader)
            dropped = Loader(P.sample_source, P.cast_step, batch_size=4, num_workers=1)
            sum(1 for _ in dropped)
            del dropped  # closed at once: no cycle

        def test_cycle(leak_check):
            box = {"loader": Loader(P.sample_source, P.cast_step, batch_size=4, num_workers=1)}
            box["self"] = box
        """
    )
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]))
    result = pytester.runpytest_subprocess("-p", "no:xdist", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*resource leak: 1 Loader(s) dropped without close()*"])
