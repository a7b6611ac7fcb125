"""Epochs that follow the trainer, in-process: ``set_epoch(e)`` (torch's DistributedSampler
convention, which Lightning calls through ``loader.sampler``) makes the next ``iter()`` run epoch
e's order; ``batch.info.step`` is the rank's step in the epoch, resumed epochs included; states
taken after a ``set_epoch`` describe that epoch and resume exactly."""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np
import pytest

from loader import Loader, LoaderClosedError
from tests import pipelines as P

pytestmark = pytest.mark.timeout(180)


def make(workers: int = 2, **kw: Any) -> Loader:
    """30 ids in batches of 4, with a captured random draw next to them (the bytes follow
    DALI's random generators)."""
    return Loader(P.sample_source, P.uniform_step, batch_size=4, num_workers=workers, **kw)


def ids(batch: Any) -> list[int]:
    values = [int(v) for v in np.asarray(batch["id"]).ravel()]
    return values[: len(values) - batch.info.padded]


def taken(loader: Loader, count: int | None = None) -> list[tuple[int, int, list[int], bytes]]:
    """(info.epoch, info.step, ids, the random draws' bytes) of ``count`` batches of the next
    epoch (all of them by default)."""
    out = []
    for batch in iter(loader):
        out.append((batch.info.epoch, batch.info.step, ids(batch), _noise(batch)))
        del batch
        if count is not None and len(out) == count:
            break
    return out


def _noise(batch: Any) -> bytes:
    return np.asarray(batch["noise"]).tobytes()


@pytest.fixture(scope="module")
def uninterrupted() -> list[list[tuple[int, int, list[int], bytes]]]:
    """Epochs 0 to 3 of one loader, never told its epoch."""
    with make() as loader:
        return [taken(loader) for _ in range(4)]


def test_a_loader_told_its_epoch_runs_that_epochs_order(
    uninterrupted: list[list[tuple[int, int, list[int], bytes]]],
) -> None:
    """A loader built at epoch 3 (Lightning's reload_dataloaders_every_n_epochs) runs epoch 3's
    order, says epoch 3 in batch.info, and counts its steps from 0; loader.epoch follows."""
    with make() as loader:
        loader.set_epoch(3)
        assert loader.epoch == 3
        assert len(loader) == len(uninterrupted[3])
        epoch = taken(loader)
        assert loader.epoch == 4
        loader.sampler.set_epoch(2)  # what Lightning calls, at any epoch
        assert loader.epoch == 2
        again = taken(loader)
    assert [b[2] for b in epoch] == [b[2] for b in uninterrupted[3]]
    assert {b[0] for b in epoch} == {3} and {b[0] for b in again} == {2}
    assert [b[1] for b in epoch] == list(range(len(epoch)))
    assert [b[2] for b in again] == [b[2] for b in uninterrupted[2]]
    assert epoch != again


def test_set_epoch_of_the_next_epoch_costs_nothing(
    uninterrupted: list[list[tuple[int, int, list[int], bytes]]],
) -> None:
    """Told the epoch it runs next anyway (Lightning, at every epoch of a loader built once),
    the loader sends nothing: one trace, no rebuild, the uninterrupted stream's bytes."""
    with make() as loader:
        epochs = []
        for epoch in range(3):
            loader.set_epoch(epoch)
            epochs.append(taken(loader))
            loader.set_epoch(epoch + 1)  # at the epoch's end, as for a validation loader
        stats = loader.stats()
    assert [w.traces for w in stats.workers] == [1, 1]
    assert [w.rebuilds for w in stats.workers] == [0, 0]
    assert epochs == uninterrupted[:3]


def test_set_epoch_in_a_half_delivered_epoch_applies_at_the_next_iter(
    uninterrupted: list[list[tuple[int, int, list[int], bytes]]],
) -> None:
    """Lightning's validation loader: the sanity check takes 2 batches of epoch 0, then the
    trainer says epoch 0 again. The iterator in hand goes on with epoch 0; the next iter()
    leaves it and runs epoch 0 from its start."""
    with make() as loader:
        iterator = iter(loader)
        first = [ids(next(iterator)) for _ in range(2)]
        loader.set_epoch(0)
        assert loader.epoch == 0
        assert loader.state_dict()["epoch"] == 0  # the epoch in progress
        third = next(iterator)
        assert third.info.epoch == 0 and third.info.step == 2
        del third
        whole = taken(loader)
        assert loader.epoch == 1
        following = taken(loader)
    assert first == [b[2] for b in uninterrupted[0][:2]]
    assert [b[2] for b in whole] == [b[2] for b in uninterrupted[0]]
    assert [b[1] for b in whole] == list(range(len(whole)))
    assert [b[2] for b in following] == [b[2] for b in uninterrupted[1]]


def test_a_state_taken_after_set_epoch_is_of_that_epoch_and_resumes_exactly() -> None:
    """Between set_epoch(3) and the epoch's start, the state is epoch 3 with nothing received
    and the random generators as seeded for epoch 3; mid-epoch it resumes byte for byte."""
    with make() as loader:
        taken(loader)  # the workers go on into epoch 1, their random draws too
        loader.set_epoch(3)
        at_start = loader.state_dict()
        whole = taken(loader)
    assert (at_start["epoch"], at_start["received"], at_start["random"]) == (3, [0, 0], [[], []])
    with make() as loader:
        loader.set_epoch(3)
        before = taken(loader, 3)
        state = json.loads(json.dumps(loader.state_dict()))
    assert state["epoch"] == 3 and state["steps"] == [3]
    for saved in (at_start, state):
        with make() as loader:
            loader.load_state_dict(saved)
            loader.set_epoch(3)  # Lightning, after it loaded the state: the same epoch keeps it
            rest = taken(loader)
        done = 0 if saved is at_start else 3
        assert ([] if saved is at_start else before) + rest == whole
        assert [b[1] for b in rest] == list(range(done, len(whole)))  # the rank's steps


def test_set_epoch_to_another_epoch_drops_a_loaded_state(
    caplog: pytest.LogCaptureFixture,
    uninterrupted: list[list[tuple[int, int, list[int], bytes]]],
) -> None:
    with make() as loader:
        loader.set_epoch(1)
        taken(loader, 3)
        state = loader.state_dict()
    caplog.set_level(logging.INFO, logger="loader")
    with make() as loader:
        loader.load_state_dict(state)
        assert loader.remaining() == len(loader) - 3
        loader.set_epoch(2)
        assert loader.remaining() == len(loader)
        assert loader.state_dict()["received"] == [0, 0]
        epoch = taken(loader)
    assert [b[2] for b in epoch] == [b[2] for b in uninterrupted[2]]
    dropped = [r for r in caplog.records if "the state loaded for epoch 1 is dropped" in r.message]
    assert len(dropped) == 1 and dropped[0].levelno == logging.WARNING


def test_a_resumed_epoch_told_its_epoch_again_runs_whole_at_the_next_iter(
    uninterrupted: list[list[tuple[int, int, list[int], bytes]]],
) -> None:
    """After a resumed epoch, set_epoch to that same epoch means its start: the loaded state
    was that run's, not the next one's."""
    with make() as loader:
        taken(loader, 3)
        state = loader.state_dict()
    with make() as loader:
        loader.load_state_dict(state)
        iterator = iter(loader)
        next(iterator)
        loader.set_epoch(0)  # (the resumed epoch goes on until the next iter())
        assert loader.state_dict()["steps"] == [4]
        rest = list(iterator)
        assert len(rest) == len(uninterrupted[0]) - 4
        del rest
        assert loader.remaining() == len(loader) == len(uninterrupted[0])
        assert loader.state_dict()["received"] == [0, 0]
        again = taken(loader)
    assert again == uninterrupted[0]


def test_set_epoch_takes_an_epoch_number() -> None:
    with make(1) as loader:
        for wrong in (-1, 1.0, True, "2", None):
            with pytest.raises(ValueError, match=r"set_epoch\(\) takes an epoch number"):
                loader.set_epoch(wrong)  # type: ignore[arg-type]
        assert loader.epoch == 0
    with pytest.raises(LoaderClosedError):
        loader.set_epoch(1)


def test_the_sampler_reaches_the_loader_without_keeping_it() -> None:
    """Lightning's own helper finds set_epoch through dataloader.sampler and
    dataloader.batch_sampler.sampler (one object: called once); the sampler holds its loader
    weakly, and a sampler kept after its loader was dropped says so."""
    data = pytest.importorskip("lightning_fabric.utilities.data")
    loader = make(1)
    sampler = loader.sampler
    assert loader.batch_sampler is sampler and sampler.sampler is sampler
    assert sampler.batch_size == 4
    data._set_sampler_epoch(loader, 5)
    assert loader.epoch == 5
    del loader  # the sampler does not keep it alive: dropping it closes it
    with pytest.raises(LoaderClosedError, match="dropped"):
        sampler.set_epoch(6)


def test_batch_info_step_is_the_ranks_step_and_worker_step_the_workers() -> None:
    """Round robin over 2 workers: info.step counts every batch of the epoch on this rank,
    info.worker_step each worker's own; a resumed epoch counts the batches received before."""
    with make() as loader:
        iterator = iter(loader)
        seen = []
        for _ in range(5):
            batch = next(iterator)
            seen.append((batch.info.step, batch.info.worker, batch.info.worker_step))
            del batch
        state = loader.state_dict()
    assert seen == [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1), (4, 0, 2)]
    with make() as loader:
        loader.load_state_dict(state)
        batch = next(iter(loader))
        assert (batch.info.step, batch.info.worker, batch.info.worker_step) == (5, 1, 2)
        del batch
