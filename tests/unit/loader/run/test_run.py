"""The run (:mod:`loader.run._run`): epochs, their order, state and resume, ``set_epoch``,
leaving an epoch early, closing and failing, over workers played by threads
(:mod:`tests.unit.loader.engine.played`; the launcher's pool class is swapped, nothing else), no
process."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from ipc import wire
from loader import Loader
from loader.config import LoaderConfig
from loader.errors import LoaderClosedError, WorkerDiedError
from loader.run import Epoch, Run
from tests import timing_pipelines as T
from tests.unit.loader.engine.conftest import _no_process_started  # noqa: F401 (autouse)
from tests.unit.loader.engine.played import PlayedPool, Script, ids


def _config(**arguments: Any) -> LoaderConfig:
    """A configuration as a Loader with these keywords (the rest as its defaults) makes it."""
    defaults = {
        name: parameter.default
        for name, parameter in inspect.signature(Loader.__init__).parameters.items()
        if parameter.default is not inspect.Parameter.empty
    }
    keywords = {**defaults, "batch_size": 2, "num_workers": 2, **arguments}
    return LoaderConfig.build(T.quick_source, T.id_step, **keywords)


@pytest.fixture
def played(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Script]]:
    """The launcher's pools are played; the test may set the script (the first item)."""
    scripts = [Script()]
    PlayedPool.made.clear()

    def pool(specs: Any, start_method: str) -> PlayedPool:
        return PlayedPool(specs, start_method, scripts[0])

    monkeypatch.setattr("loader.run._launcher.WorkerPool", pool)
    yield scripts
    for made in PlayedPool.made:
        made.close()
    PlayedPool.made.clear()


@pytest.fixture
def run(played: list[Script]) -> Iterator[Run]:
    made = Run(_config())
    yield made
    made.close()


def _ids(batch: Any) -> list[int]:
    return [int(v) for v in np.asarray(batch["id"])]


def _rest(run: Run, epoch: Epoch) -> list[tuple[int, list[int]]]:
    """(step, ids) of every batch left in ``epoch``."""
    got = []
    while True:
        try:
            batch = run.next_batch(epoch)
        except StopIteration:
            return got
        got.append((batch.info.step, _ids(batch)))


def _whole(epoch: int) -> list[tuple[int, list[int]]]:
    order = [(w, s) for s in range(4) for w in range(2)]
    return [(k, ids(w, s, epoch, 2, 4)) for k, (w, s) in enumerate(order)]


def _commands(kind: type) -> list[Any]:
    return [c for w in PlayedPool.made[-1].handles for c in w.commands if isinstance(c, kind)]


def test_epochs_come_whole_in_order_and_the_next_one_follows(run: Run) -> None:
    assert run.length() == run.remaining() == 8
    epoch = run.open_epoch()
    assert not epoch.started and run.epoch == 0  # lazy: nothing asked of the workers yet
    assert _rest(run, epoch) == _whole(0)
    assert epoch.finished and epoch.delivered == 8 and run.epoch == 1
    assert run.remaining() == 8  # between epochs: the next one
    second = run.open_epoch()
    assert _rest(run, second) == _whole(1)
    assert run.stats(10.0).batches == 16


def test_a_state_saved_mid_epoch_resumes_the_batches_not_handed_out(played: list[Script]) -> None:
    first = Run(_config())
    epoch = first.open_epoch()
    before = [(b.info.step, _ids(b)) for b in (first.next_batch(epoch) for _ in range(3))]
    state = first.state()
    first.close()
    assert before == _whole(0)[:3]
    second = Run(_config())
    try:
        second.load(state, strict=True)
        assert (second.epoch, second.remaining(), second.length()) == (0, 5, 8)
        assert _rest(second, second.open_epoch()) == _whole(0)[3:]
        assert len(_commands(wire.Seek)) == 2  # every worker was moved to the saved position
        assert second.remaining() == 8 and second.epoch == 1
    finally:
        second.close()


def test_a_new_epoch_mid_epoch_stops_the_old_one_everywhere(run: Run) -> None:
    old = run.open_epoch()
    assert [run.next_batch(old).info.step for _ in range(2)] == [0, 1]
    new = run.open_epoch()
    assert old.replaced and old.finished
    assert len(_commands(wire.AbortEpoch)) == 2
    with pytest.raises(RuntimeError, match="was replaced by a newer iter"):
        run.next_batch(old)
    assert _rest(run, new) == _whole(1)


def test_set_epoch_moves_the_workers_to_that_epoch_at_its_start(run: Run) -> None:
    run.set_epoch(3)
    epoch = run.open_epoch()
    assert not _commands(wire.Seek)  # a query until the epoch starts
    assert _rest(run, epoch) == _whole(3)
    assert [c.position for c in _commands(wire.Seek)] == [wire.Position(3, ())] * 2
    for wrong in (-1, True, 1.0):
        with pytest.raises(ValueError, match="set_epoch"):
            run.set_epoch(wrong)  # type: ignore[arg-type]


def test_set_epoch_drops_a_loaded_state_of_another_epoch(
    run: Run, caplog: pytest.LogCaptureFixture
) -> None:
    epoch = run.open_epoch()
    run.next_batch(epoch)
    state = run.state()
    run.load(state, strict=True)
    assert epoch.replaced and run.pending is not None
    caplog.set_level(logging.WARNING, logger="loader")
    run.set_epoch(2)
    assert run.pending is None
    assert "the state loaded for epoch 0 is dropped" in caplog.text
    assert _rest(run, run.open_epoch()) == _whole(2)


def test_a_closed_run_refuses_everything_and_closes_its_pool(run: Run) -> None:
    run.close()
    assert run.closed and PlayedPool.made[-1].closed
    for call in (run.pids, run.length, run.open_epoch, run.state):
        with pytest.raises(LoaderClosedError, match="closed"):
            call()


def test_a_failure_shuts_the_run_down_and_says_why(played: list[Script]) -> None:
    played[0] = Script(before_batch=lambda worker, epoch, step: (worker, step) != (1, 2))
    run = Run(_config())
    try:
        epoch = run.open_epoch()
        with pytest.raises(WorkerDiedError):
            _rest(run, epoch)
        assert run.closed
        with pytest.raises(LoaderClosedError, match="shut down after a failure"):
            run.require()
    finally:
        run.close()


def test_a_source_without_positions_has_no_state_and_no_length(played: list[Script]) -> None:
    played[0] = Script(sampling=False)
    run = Run(_config())
    try:
        with pytest.raises(TypeError, match=r"state_dict\(\)/load_state_dict\(\) need"):
            run.state()
        with pytest.raises(TypeError, match="unknown for this source"):
            run.length()
        assert run.fingerprint() is None
        assert _rest(run, run.open_epoch()) == _whole(0)  # it still delivers its epochs
    finally:
        run.close()


def test_a_half_built_run_closes_what_it_started(
    played: list[Script], monkeypatch: pytest.MonkeyPatch
) -> None:
    played[0] = Script(silent=True)
    with pytest.raises(Exception, match="startup_timeout"):
        Run(_config(startup_timeout=0.3))
    assert PlayedPool.made and all(pool.closed for pool in PlayedPool.made)
