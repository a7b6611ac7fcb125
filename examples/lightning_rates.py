"""The loader's rates in Lightning's logger: a callback that logs a few scalars every N steps.

    python examples/lightning_rates.py --epochs 2 --logdir lightning_logs

``rates_callback(loader, every_n_steps=50)`` logs ``loader.stats().rates()`` from
``on_train_batch_end`` to every logger of the Trainer (TensorBoard, CSV, Weights & Biases, ...)
with ``log_metrics``, at the step they were measured (``pl_module.log`` from a callback would
log the last values again at every later step): ``loader/waiting`` (the fraction of the loop's
time spent waiting for data over the last ``window`` seconds), ``loader/batches_per_second``,
``loader/worker_<stage>`` (each stage's share of the workers' time: load, dali, blocked,
publish, idle) and ``loader/worker_cpus``. ``loader/waiting`` near 0 means the GPU never waits
for data; see ``loader.diagnose()`` for what to change when it does not.

The data is synthetic (a float vector per sample id, made in ``load``); the model is a linear
classifier. torch and Lightning are imported inside the functions that need them: every loader
worker imports this script (workers are spawned) and needs neither.

Lightning is imported as its docs do, ``import lightning as L``; with ``pytorch_lightning`` (the
same Lightning under its standalone package name) the callback is the same, made from
``pytorch_lightning.Callback`` and given to a ``pytorch_lightning.Trainer`` (a Trainer takes the
callbacks of its own package only).
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from loader import Loader, SamplesDataset, ndd

FEATURES = 8
CLASSES = 3


def _sample(index: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    rng = np.random.default_rng(index)
    return rng.standard_normal(FEATURES).astype(np.float32), np.array([index % CLASSES])


def step(features: Any, labels: Any) -> dict[str, Any]:
    return {"x": ndd.cast(features, dtype=ndd.float32), "y": ndd.cast(labels, dtype=ndd.int64)}


def rates_callback(loader: Loader, every_n_steps: int = 50, window: float = 10.0) -> Any:
    """A Lightning ``Callback`` that logs the loader's rates every ``every_n_steps`` batches of
    an epoch (made by a function: Lightning is imported only in the trainer)."""
    import lightning as L

    class LoaderRates(L.Callback):
        def on_train_batch_end(
            self,
            trainer: L.Trainer,
            pl_module: L.LightningModule,
            outputs: Any,
            batch: Any,
            batch_idx: int,
        ) -> None:
            if batch_idx % every_n_steps == every_n_steps - 1:
                rates = loader.stats(window).rates()
                for logger in trainer.loggers:  # at this step only (self.log would repeat them)
                    logger.log_metrics(rates, step=trainer.global_step)

    return LoaderRates()


def build_module() -> Any:
    import lightning as L
    import torch

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(FEATURES, CLASSES)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            logits = self.layer(batch["x"])
            loss = torch.nn.functional.cross_entropy(logits, batch["y"].reshape(-1))
            self.log("loss", loss, batch_size=logits.shape[0])
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Classifier()


def train(
    *,
    samples: int,
    batch_size: int,
    epochs: int,
    workers: int,
    every: int,
    logger: Any,
) -> Loader:
    """Fit the classifier with the callback; returns the (closed) loader."""
    import lightning as L

    data = SamplesDataset(samples, _sample, num_outputs=2)
    with Loader(data, step, batch_size=batch_size, num_workers=workers, output="torch") as loader:
        trainer = L.Trainer(
            max_epochs=epochs,
            accelerator="cpu",
            devices=1,
            logger=logger,
            log_every_n_steps=1,
            callbacks=[rates_callback(loader, every_n_steps=every)],
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            use_distributed_sampler=False,
        )
        trainer.fit(build_module(), train_dataloaders=loader)
    return loader


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--logdir", default="lightning_logs")
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--every", type=int, default=20)
    args = parser.parse_args()

    from lightning.pytorch.loggers import CSVLogger

    train(
        samples=args.samples,
        batch_size=args.batch_size,
        epochs=args.epochs,
        workers=args.workers,
        every=args.every,
        logger=CSVLogger(args.logdir, name="loader-rates"),
    )


if __name__ == "__main__":  # required: workers are spawned and import this module
    main()
