"""Lightning training fed by a dali-capture-loader, with checkpoints that resume mid-epoch.

    python examples/lightning_train.py --epochs 3 --every 6 --ckpt-dir ckpts
    python examples/lightning_train.py --devices 2 --strategy ddp --every 6 --ckpt-dir ckpts
    python examples/lightning_train.py --resume ckpts/step-030.ckpt --ckpt-dir ckpts

Lightning is imported as its docs do, ``import lightning as L`` (``L.Trainer`` is
``lightning.pytorch.Trainer``). ``pytorch_lightning``, the same Lightning under its standalone
package name, works the same: ``--lightning-package pytorch_lightning`` runs this script with it
(one package end to end: a Trainer of one does not take the modules or callbacks of the other).

The Loader goes to ``trainer.fit`` as it is, like a DataLoader. Lightning keeps its state in every
checkpoint by itself (the Loader has ``state_dict``/``load_state_dict``, so Lightning's
CombinedLoader stores it under ``checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]``)
and gives it back on ``fit(ckpt_path=...)``: the interrupted epoch goes on with the batches not yet
received, then every later epoch runs as if there had been no interruption.

- The Loader is built before ``trainer.fit``, before Lightning's DDP launcher has set up the ranks
  (the rank-1 process re-runs this script with ``WORLD_SIZE`` and ``LOCAL_RANK`` set but not
  ``RANK``); the loader settles its rank from the process group at the first epoch.
- ``batch.info`` (epoch, step, worker, shard, padded rows) is still there in ``training_step``,
  after Lightning moved the batch to the device.
- The loader shards itself, so ``use_distributed_sampler=False`` (Lightning only ever replaces the
  sampler of a ``torch.utils.data.DataLoader``; the flag says what this script means).

The data is ``--samples`` synthetic samples (a float vector per sample id, made in ``load``), or
with ``--data DIR`` the images of an ImageFolder, decoded by DALI to 16x16.

``--log FILE`` appends one JSON line per event: ``step`` (per ``training_step``: rank, epoch,
``global_step`` = optimizer steps taken before this batch, ``len(loader)``, the batch's real
sample ids and its ``batch.info``), ``epoch_start`` (``len(loader)``), ``killed`` and, when
``fit`` returns, ``end`` (per-worker traces, rebuilds and restarts, a digest of the weights, and
the module of the Trainer class that ran).
A checkpoint written at global step K (``step-K.ckpt``) holds every batch logged with
``global_step < K``. ``--kill-at-step K`` SIGKILLs every rank right after the checkpoint of step K
is written, as a crash.

torch, Lightning and DALI are imported inside the functions that need them: every loader worker
imports this script (workers are spawned) and needs no torch or Lightning, and the trainer needs
no DALI (``import loader`` does not import it).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np

from loader import FilesDataset, Loader, SamplesDataset, list_images, ndd

FEATURES = 8
CLASSES = 3


# ------------------------------------------------------------------ data: runs in the workers


def make_sample(index: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Sample ``index``: a float vector drawn from the id, and the id itself."""
    features = np.random.default_rng([7, index]).standard_normal(FEATURES).astype(np.float32)
    return features, np.array([index], dtype=np.int64)


def feature_step(features: Any, ids: Any) -> dict[str, Any]:
    return {"x": ndd.cast(features, dtype=ndd.float32), "id": ndd.cast(ids, dtype=ndd.int64)}


def image_dataset(root: str) -> FilesDataset:
    """The images of an ImageFolder; a file's label is its index in the sorted list (its id)."""
    files, _classes = list_images(root)
    return FilesDataset(files, labels=list(range(len(files))))


def image_step(jpegs: Any, ids: Any) -> dict[str, Any]:
    images = ndd.decoders.image(jpegs, device="cpu")
    images = ndd.resize(images, size=[16, 16])
    images = ndd.crop_mirror_normalize(images, dtype=ndd.float32, mean=[128.0] * 3, std=[64.0] * 3)
    return {"x": images, "id": ndd.cast(ids, dtype=ndd.int64)}


def build_loader(args: argparse.Namespace) -> Loader:
    dataset: FilesDataset | SamplesDataset  # each sample once per epoch, shuffled
    if args.data is not None:
        dataset, step = image_dataset(str(args.data)), image_step
    else:
        dataset, step = SamplesDataset(args.samples, make_sample, num_outputs=2), feature_step
    return Loader(
        dataset,
        step,
        batch_size=args.batch_size,
        num_workers=args.workers,
        output="torch",
        seed=args.seed,
        num_threads=args.dali_threads,
    )


# ------------------------------------------------------------------ the trainer's side


class JsonLog:
    """Appends one JSON line per record; every line is one ``write`` to a file opened for
    appending, so the ranks of a job can share the file."""

    def __init__(self, path: Path | None) -> None:
        self.path = path

    def write(self, **record: Any) -> None:
        if self.path is None:
            return
        line = (json.dumps({**record, "time": round(time.time(), 3)}) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)


def info_record(info: Any) -> dict[str, Any] | None:
    return None if info is None else dataclasses.asdict(info)


def weights_digest(module: Any) -> str:
    """A fingerprint of the weights, to compare runs."""
    digest = hashlib.sha256()
    for tensor in module.state_dict().values():
        digest.update(tensor.detach().cpu().numpy().tobytes())
    return digest.hexdigest()


def fit(args: argparse.Namespace, loader: Loader, log: JsonLog) -> None:
    import torch
    import torch.nn.functional as F

    if args.lightning_package == "lightning":
        import lightning as L
        from lightning.pytorch.callbacks import ModelCheckpoint
    else:  # the same classes under Lightning's standalone package name
        import pytorch_lightning as L  # type: ignore[no-redef]
        from pytorch_lightning.callbacks import ModelCheckpoint  # type: ignore[no-redef]

    class TinyModel(L.LightningModule):
        """A linear model on the synthetic features, or a tiny CNN on the images."""

        def __init__(self, images: bool) -> None:
            super().__init__()
            if images:
                self.net: torch.nn.Module = torch.nn.Sequential(
                    torch.nn.Conv2d(3, 4, 3, stride=2),
                    torch.nn.ReLU(),
                    torch.nn.AdaptiveAvgPool2d(1),
                    torch.nn.Flatten(),
                    torch.nn.Linear(4, CLASSES),
                )
            else:
                self.net = torch.nn.Linear(FEATURES, CLASSES)
            self._info_before_transfer: Any = None

        def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            # only to tell padding apart in the log should batch.info not reach training_step
            self._info_before_transfer = getattr(batch, "info", None)
            return batch

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            inputs, ids = batch["x"], batch["id"].reshape(-1)
            loss = F.cross_entropy(self.net(inputs), ids % CLASSES)
            info = getattr(batch, "info", None)  # what the loader says about this batch
            known = info if info is not None else self._info_before_transfer
            padded = known.padded if known is not None else 0
            log.write(
                event="step",
                rank=self.global_rank,
                world_size=self.trainer.world_size,
                epoch=self.current_epoch,
                global_step=self.global_step,
                batch_idx=batch_idx,
                len=len(loader),
                ids=ids[: len(ids) - padded].tolist(),
                padded=padded,
                info=info_record(info),
                info_before_transfer=info_record(self._info_before_transfer),
            )
            return loss

        def on_train_epoch_start(self) -> None:
            log.write(
                event="epoch_start",
                rank=self.global_rank,
                epoch=self.current_epoch,
                len=len(loader),
                batches=self.trainer.num_training_batches,
            )

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    class CheckpointThenKill(ModelCheckpoint):
        """A ModelCheckpoint that SIGKILLs this rank once the checkpoint of ``kill_at`` is written
        (Lightning runs checkpoint callbacks after all others, so the kill goes here)."""

        def __init__(self, kill_at: int | None, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.kill_at = kill_at

        def on_train_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
            super().on_train_batch_end(trainer, *args, **kwargs)  # saves; all ranks wait for it
            if self.kill_at is not None and trainer.global_step == self.kill_at:
                log.write(event="killed", rank=trainer.global_rank, global_step=trainer.global_step)
                trainer.strategy.barrier()  # (every rank's record written before the first dies)
                os.kill(os.getpid(), signal.SIGKILL)

    torch.manual_seed(args.seed)
    model = TinyModel(images=args.data is not None)
    callbacks = []
    if args.every:
        callbacks.append(
            CheckpointThenKill(
                args.kill_at_step,
                dirpath=args.ckpt_dir,
                filename="step-{step:03d}",
                auto_insert_metric_name=False,
                every_n_train_steps=args.every,
                save_top_k=-1,
            )
        )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=args.strategy,
        max_epochs=args.epochs,
        callbacks=callbacks,
        enable_checkpointing=bool(callbacks),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    trainer.fit(model, train_dataloaders=loader, ckpt_path=args.resume)
    log.write(
        event="end",
        rank=trainer.global_rank,
        world_size=trainer.world_size,
        global_step=trainer.global_step,
        epoch=trainer.current_epoch,
        loader_epoch=loader.epoch,
        workers=[
            {
                "worker": w.worker,
                "shard": w.shard,
                "steps": w.steps,
                "traces": w.traces,
                "rebuilds": w.rebuilds,
                "restarts": w.restarts,
            }
            for w in loader.stats().workers
        ],
        weights=weights_digest(model),
        trainer=type(trainer).__module__,  # lightning.pytorch.* or pytorch_lightning.*
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=None, help="ImageFolder; default: synthetic")
    parser.add_argument("--samples", type=int, default=96, help="synthetic samples")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2, help="loader workers per rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dali-threads", type=int, default=None, help="default: the loader's")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--strategy", default="auto", help="auto, or ddp (gloo on CPU)")
    parser.add_argument("--every", type=int, default=0, help="checkpoint every N global steps")
    parser.add_argument("--ckpt-dir", type=Path, default=Path("checkpoints"))
    parser.add_argument("--resume", type=Path, default=None, help="a checkpoint to resume from")
    parser.add_argument("--log", type=Path, default=None, help="append JSON lines here")
    parser.add_argument(
        "--lightning-package",
        choices=["lightning", "pytorch_lightning"],
        default="lightning",
        help="the package to import Lightning from (the same Lightning under either name)",
    )
    parser.add_argument(
        "--kill-at-step",
        type=int,
        default=None,
        help="SIGKILL every rank right after the checkpoint of this global step is written",
    )
    args = parser.parse_args()
    log = JsonLog(args.log)
    # built before fit, hence before Lightning's DDP launcher sets up the ranks
    with build_loader(args) as loader:
        fit(args, loader, log)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
