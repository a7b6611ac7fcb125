"""The real Lightning Trainer, in this process (CPU, one device), with the loaders built in
``train_dataloader()``/``val_dataloader()`` and either remade every epoch
(``reload_dataloaders_every_n_epochs=1``) or built once: every epoch is the trainer's (its order,
the dataset once, ``batch.info.epoch``), a remade loader of an earlier epoch is closed (its
workers gone) when the next epoch starts, and validation follows the trainer's epoch too, sanity
check included. Lightning calls ``loader.sampler.set_epoch`` at every epoch; it must not take the
loader for a DataLoader to re-make.

Every case runs under both of Lightning's package names, ``lightning.pytorch`` (``import lightning
as L``) and ``pytorch_lightning``: each fit uses one of them end to end (its Trainer, and a
LightningModule made from the same package)."""

from __future__ import annotations

import functools
import importlib
import weakref
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from loader import Loader
from tests import pipelines as P
from tests.integration._jobs import alive

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(240)

#: Lightning's package names, as imported (``import lightning as L`` is lightning.pytorch's)
PACKAGES = ["lightning.pytorch", "pytorch_lightning"]

TRAIN = 30  # ids, batches of 4 over 2 workers
VALIDATION = 12  # ids, batches of 4 over 1 worker: 3 batches
EPOCHS = 3


def ids(batch: Any) -> list[int]:
    values = [int(v) for v in np.asarray(batch["id"]).ravel()]
    return values[: len(values) - batch.info.padded]


@functools.cache
def recorder_class(pl: ModuleType) -> Any:
    """The Recorder of package ``pl``: a Trainer takes a LightningModule of its own package only."""

    class Recorder(pl.LightningModule):  # type: ignore[misc,name-defined]
        """Builds the loaders where Lightning asks for them and writes down what it sees; it keeps
        no loader (only weak references), as a LightningModule need not."""

        def __init__(self, reload: bool) -> None:
            super().__init__()
            self.reload = reload
            self.layer = torch.nn.Linear(1, 1)
            self.train_loaders: list[weakref.ref[Loader]] = []
            self.val_loaders: list[weakref.ref[Loader]] = []
            self.train_pids: list[list[int]] = []
            #: at each epoch's start: (epoch, workers alive of each train loader built so far)
            self.starts: list[tuple[int, list[list[int]]]] = []
            #: (trainer's epoch, batch_idx, info.epoch, info.step, ids)
            self.train_batches: list[tuple[int, int, int, int, list[int]]] = []
            #: (trainer's epoch, sanity checking, batch_idx, info.epoch, info.step, ids)
            self.val_batches: list[tuple[int, bool, int, int, int, list[int]]] = []

        def train_dataloader(self) -> Loader:
            loader = Loader(
                P.sample_source, P.cast_step, batch_size=4, num_workers=2, output="torch"
            )
            self.train_loaders.append(weakref.ref(loader))
            self.train_pids.append(loader.worker_pids())
            return loader

        def val_dataloader(self) -> Loader:
            source = functools.partial(P.sample_source, total=VALIDATION)
            loader = Loader(source, P.cast_step, batch_size=4, num_workers=1, output="torch")
            self.val_loaders.append(weakref.ref(loader))
            return loader

        def on_train_epoch_start(self) -> None:
            self.starts.append((self.current_epoch, [alive(pids) for pids in self.train_pids]))

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            info = batch.info
            self.train_batches.append(
                (self.current_epoch, batch_idx, info.epoch, info.step, ids(batch))
            )
            return self.layer(batch["id"].float()).sum()

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            info = batch.info
            sanity = self.trainer.sanity_checking
            self.val_batches.append(
                (self.current_epoch, sanity, batch_idx, info.epoch, info.step, ids(batch))
            )

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Recorder


@pytest.fixture(scope="module", params=PACKAGES)
def pl(request: pytest.FixtureRequest) -> ModuleType:
    """Lightning, under one of its package names."""
    pytest.importorskip(request.param)
    return importlib.import_module(request.param)


@pytest.fixture(scope="module", params=[True, False], ids=["reloaded", "built-once"])
def fitted(request: pytest.FixtureRequest, pl: ModuleType) -> tuple[Any, dict[str, Any]]:
    """One fit of 3 epochs, validated at every epoch; the loaders remade at every epoch, or
    built once."""
    model = recorder_class(pl)(request.param)
    trainer = pl.Trainer(
        max_epochs=EPOCHS,
        reload_dataloaders_every_n_epochs=1 if model.reload else 0,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    try:
        trainer.fit(model)
        train, validation = trainer.train_dataloader, trainer.val_dataloaders
        seen = {
            "train": train,
            "validation": validation,
            "train_is_last_built": train is model.train_loaders[-1](),
            "validation_is_built": validation is model.val_loaders[-1](),
            "samplers": tuple(
                type(getattr(x, "sampler", None)).__name__ for x in (train, validation)
            ),
            "trainer": type(trainer).__module__,
        }
    finally:
        # Lightning keeps the last loaders (the trainer's own reference cycles keep it, until
        # the garbage collector runs): close them
        for loader in (trainer.train_dataloader, trainer.val_dataloaders):
            if isinstance(loader, Loader):
                loader.close()
    return model, seen


def test_each_epoch_is_the_trainers_a_new_order_and_the_dataset_once(
    fitted: tuple[Any, dict[str, Any]],
) -> None:
    model, _seen = fitted
    assert len(model.train_loaders) == (EPOCHS if model.reload else 1)
    orders = []
    for epoch in range(EPOCHS):
        batches = [b for b in model.train_batches if b[0] == epoch]
        assert batches, f"no batches in epoch {epoch}"
        assert [b[2] for b in batches] == [epoch] * len(batches), "info.epoch is not the trainer's"
        assert [b[3] for b in batches] == [b[1] for b in batches], "info.step is not batch_idx"
        order = [i for b in batches for i in b[4]]
        assert sorted(order) == list(range(TRAIN)), f"epoch {epoch} is not the dataset once"
        orders.append(order)
    assert len({tuple(order) for order in orders}) == EPOCHS, "an epoch's order was repeated"


def test_an_earlier_epochs_loader_is_closed_when_the_next_epoch_starts(
    fitted: tuple[Any, dict[str, Any]],
) -> None:
    """Lightning drops the loader of the last epoch when it makes the next one: nothing else
    refers to it, so it closes then (no garbage collection needed). A loader built once keeps
    its workers."""
    model, _seen = fitted
    assert [epoch for epoch, _ in model.starts] == list(range(EPOCHS))
    for epoch, workers in model.starts:
        *earlier, current = workers
        assert earlier == [[]] * len(earlier), f"at epoch {epoch}'s start, alive: {earlier}"
        assert current == model.train_pids[-1 if not model.reload else epoch]
    assert all(ref() is None for ref in model.train_loaders[:-1])


def test_a_validation_loader_built_once_follows_the_trainers_epoch(
    fitted: tuple[Any, dict[str, Any]],
) -> None:
    """The sanity check takes epoch 0's first 2 batches; epoch 0's validation then runs epoch 0
    whole from its start (the half-delivered epoch is left, set_epoch(0) applies at the next
    iter), and every later validation runs the trainer's epoch, the set once."""
    model, _seen = fitted
    assert len(model.val_loaders) == (EPOCHS if model.reload else 1)  # (sanity's kept for 0)
    sanity = [v for v in model.val_batches if v[1]]
    assert [(v[3], v[4]) for v in sanity] == [(0, 0), (0, 1)]
    batches = VALIDATION // 4
    for epoch in range(EPOCHS):
        runs = [v for v in model.val_batches if not v[1] and v[0] == epoch]
        assert [(v[3], v[4]) for v in runs] == [(epoch, step) for step in range(batches)]
        assert sorted(i for v in runs for i in v[5]) == list(range(VALIDATION))
    first = [v[5] for v in model.val_batches if not v[1] and v[0] == 0]
    assert [v[5] for v in sanity] == first[:2]  # the sanity check saw epoch 0's first batches


def test_lightning_takes_the_loader_as_it_is(
    fitted: tuple[Any, dict[str, Any]], pl: ModuleType
) -> None:
    """Not a DataLoader: Lightning neither re-makes it nor puts its own sampler in."""
    _model, seen = fitted
    assert seen["trainer"].startswith(f"{pl.__name__}."), "the fit ran another package's Trainer"
    assert seen["train_is_last_built"] and seen["validation_is_built"]
    assert seen["samplers"] == ("EpochSampler", "EpochSampler")
    assert seen["train"].closed and seen["validation"].closed


def holder_class(pl: ModuleType) -> Any:
    """A LightningModule of package ``pl`` that holds a loader given to it, at this module's
    top level (where pickle finds a class: ddp_spawn pickles the module to get to its loader)."""
    name = f"Holder_{pl.__name__.replace('.', '_')}"
    if name not in globals():

        def __init__(self: Any, loader: Loader) -> None:
            pl.LightningModule.__init__(self)
            self.loader = loader
            self.layer = torch.nn.Linear(1, 1)

        def train_dataloader(self: Any) -> Loader:
            return self.loader

        made = type(name, (pl.LightningModule,), {"__init__": __init__})
        made.train_dataloader = train_dataloader
        made.__module__, made.__qualname__ = __name__, name
        globals()[name] = made
    return globals()[name]


def test_a_loader_built_before_a_ddp_spawn_fit_is_refused_saying_where_to_build_it(
    pl: ModuleType,
) -> None:
    """``strategy="ddp_spawn"`` pickles the LightningModule into each rank: a loader it holds
    failed deep in multiprocessing with ``cannot pickle '_thread.lock' object``."""

    Holder = holder_class(pl)
    trainer = pl.Trainer(
        strategy="ddp_spawn",
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with Loader(P.id_source, P.cast_step, batch_size=4, num_workers=1) as loader:
        with pytest.raises(TypeError, match=r"cannot be sent to another process.*ddp_spawn"):
            trainer.fit(Holder(loader))
