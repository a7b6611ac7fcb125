"""The trainer's conventions (torch's DataLoader, Lightning, accelerate), in-process: len() is
the epoch's length, iter() is lazy, an epoch is over at its last batch, states name the next
epoch then, batch.info survives a device transfer, and malformed states are refused."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from loader import Loader
from tests import pipelines as P

pytestmark = pytest.mark.timeout(180)


def make(workers: int = 2, **kw: Any) -> Loader:
    return Loader(P.sample_source, P.cast_step, batch_size=4, num_workers=workers, **kw)


def ids(batch: Any) -> list[int]:
    values = [int(v) for v in np.asarray(batch["id"]).ravel()]
    return values[: len(values) - batch.info.padded]


def first(loader: Loader, count: int) -> list[list[int]]:
    """``count`` batches of the next epoch, as a trainer that stops after them takes them."""
    iterator = iter(loader)
    return [ids(next(iterator)) for _ in range(count)]


def test_an_epoch_taken_by_its_length_costs_no_rebuild() -> None:
    """A trainer that throws one iterator away and takes exactly len() batches per epoch (as
    Lightning does) never aborts an epoch: 3 epochs, one trace and no rebuild per worker."""
    with make() as loader:
        iter(loader)  # thrown away: starts nothing
        assert loader.epoch == 0
        epochs = []
        for _ in range(3):
            epochs.append(first(loader, len(loader)))
            assert loader.state_dict()["received"] == [0, 0]  # the next epoch, nothing received
        stats = loader.stats()
        assert loader.epoch == 3
    assert [w.traces for w in stats.workers] == [1, 1]
    assert [w.rebuilds for w in stats.workers] == [0, 0]
    for epoch in epochs:
        assert sorted(i for batch in epoch for i in batch) == list(range(30))
    assert epochs[0] != epochs[1]  # each its own shuffle: no epoch was repeated or skipped


def test_len_is_the_epochs_length_before_and_after_a_resume() -> None:
    """Thrown-away iterators change nothing; a resumed epoch has the epoch's len(), yields the
    rest with the epoch's step numbers, and a state taken in it counts every batch received
    (resumed twice in one epoch: the first run's batches too)."""

    def steps(batches: list[Any]) -> list[tuple[int, int]]:
        return [(b.info.worker, b.info.step) for b in batches]

    with make() as loader:
        for _ in range(3):
            iter(loader)  # thrown away: starts nothing, not even the epoch counter
        assert loader.epoch == 0 and loader.remaining() == 8
        assert loader.state_dict()["epoch"] == 0
        numbers, epoch0 = [], []
        for batch in loader:
            numbers.append((batch.info.worker, batch.info.step))
            epoch0.append(ids(batch))
        uninterrupted = [epoch0, first(loader, 8)]
        del batch
    with make() as loader:
        before = first(loader, 5)
        assert len(loader) == 8 and loader.remaining() == 3
        state = json.loads(json.dumps(loader.state_dict()))
    assert state["steps"] == [5]
    with make() as loader:
        loader.load_state_dict(state)
        assert len(loader) == 8  # the whole epoch, as a trainer that restores its count needs
        assert loader.remaining() == 3
        iterator = iter(loader)
        assert len(iterator) == 3
        sixth = next(iterator)
        assert (sixth.info.worker, sixth.info.step) == numbers[5]  # the epoch's step, not 0
        again = json.loads(json.dumps(loader.state_dict()))
        rest = [ids(sixth)] + [ids(b) for b in iterator]
        del sixth
        assert len(loader) == 8 and loader.remaining() == 8
        after = first(loader, 8)
    assert before + rest == uninterrupted[0]
    assert after == uninterrupted[1]
    assert again["steps"] == [6]  # 5 before the first resume, 1 after it
    with make() as loader:
        loader.load_state_dict(again)
        assert (len(loader), loader.remaining()) == (8, 2)
        last = list(loader)
        assert [ids(b) for b in last] == uninterrupted[0][6:]
        assert steps(last) == numbers[6:]
        del last


def test_received_counts_must_be_counts_within_the_epoch() -> None:
    with make() as loader:
        first(loader, 2)
        state = loader.state_dict()
        for received, match in (
            ([999, 0], r"received: shard 0 of 2 \(on 1 rank\(s\)\) received 999 batches"),
            ([3.0, 2.0], r"received\[0\]: 3.0 is not a count of batches"),
            ([-1, 0], r"received\[0\]: -1 is not a count"),
            ([True, 0], r"received\[0\]: True is not a count"),
        ):
            with pytest.raises(ValueError, match=match):
                loader.load_state_dict({**state, "received": received})
        with pytest.raises(ValueError, match=r"^steps: "):
            loader.load_state_dict({**state, "steps": [1, 2, 3]})
        assert loader.remaining() == 6  # nothing was applied: the epoch goes on


def test_batch_info_survives_a_device_transfer() -> None:
    """What Lightning (apply_to_collection over objects with .to), accelerate (send_to_device)
    and torch.utils._pytree do to a batch keeps its info."""
    torch = pytest.importorskip("torch")
    from torch.utils import _pytree

    with make(1, output="torch") as loader:
        batch = next(iter(loader))
        info = batch.info
        moved = batch.to("cpu")
        assert moved.info == info and torch.equal(moved["id"], batch["id"])
        assert type(moved) is type(batch)
        mapped = _pytree.tree_map(lambda t: t + 1, batch)
        assert mapped.info == info and torch.equal(mapped["id"], batch["id"] + 1)
        lightning = pytest.importorskip("pytorch_lightning.utilities")
        assert lightning.move_data_to_device(batch, torch.device("cpu")).info == info
        assert lightning.move_data_to_device([batch], torch.device("cpu"))[0].info == info
        accelerate_ops = pytest.importorskip("accelerate.utils.operations")
        assert accelerate_ops.send_to_device(batch, "cpu").info == info
        del batch, moved, mapped


def test_accelerate_synchronises_gradients_at_the_epochs_end() -> None:
    """accelerate's accumulate() syncs every ``gradient_accumulation_steps`` batches and at the
    last batch of each epoch (the dataloader protocol), as for a prepared DataLoader."""
    pytest.importorskip("accelerate")
    torch = pytest.importorskip("torch")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    try:
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=3)
        model = torch.nn.Linear(1, 1)
        model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        with make(output="torch") as loader:
            assert accelerator.prepare(loader) is loader
            synced = []
            for _ in range(2):
                for batch in loader:
                    with accelerator.accumulate(model):
                        loss = model(batch["id"].float()).mean()
                        accelerator.backward(loss)
                        synced.append(accelerator.sync_gradients)
                        optimizer.step()
                        optimizer.zero_grad()
                assert not GradientState().in_dataloader or loader.remaining() == 8
            del batch
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    # 8 batches an epoch: steps 3 and 6 by count, 8 by the epoch's end; the count restarts
    one_epoch = [False, False, True, False, False, True, False, True]
    assert synced == one_epoch * 2
