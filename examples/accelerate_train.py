"""Hugging Face accelerate training fed by a dali-capture-loader, with gradient accumulation and
``save_state``/``load_state`` mid-epoch.

    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_train.py --save-every 5
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_train.py \\
        --resume checkpoints/step-010
    python examples/accelerate_train.py --resume checkpoints/step-010      # one process

``Accelerator(cpu=True)`` trains on the CPU with gloo. With accelerate 1.15, ``accelerate launch
--cpu --num_processes 2`` starts one process (more CPU processes need ``--mpirun_hostfile``);
``--multi_gpu --num_processes 2`` starts two through ``torch.distributed.run`` and, with
``cpu=True``, they train on the CPU (``DistributedType.MULTI_CPU``).

- ``accelerator.register_for_checkpointing(loader, progress)``: ``save_state`` stores the loader's
  state (``state_dict()`` is a collective: every process calls it, the main process writes it) and
  ``load_state`` gives it back before the first ``iter(loader)``; the interrupted epoch then goes on
  with the batches not yet received, on the same number of processes or another.
- ``accelerator.prepare`` leaves a non-DataLoader iterable as it is, and gradient accumulation
  needs to know where an epoch ends: with an epoch length that is not a multiple of the
  accumulation steps, ``accumulate()`` must still sync on the epoch's last batch. The loader's
  epoch iterator tells accelerate's ``GradientState`` as accelerate's own ``DataLoaderShard`` does
  (it registers as the active dataloader at its first batch and sets ``end_of_dataloader`` before
  handing out the last one), so a plain ``for batch in loader`` is all it takes.

torch, accelerate and DALI are imported inside the functions that need them: every loader worker
imports this script (workers are spawned) and needs no torch or accelerate, and the trainer needs
no DALI.

``--log FILE`` appends one JSON line per event: ``step`` (per batch: rank, epoch, ``global_step`` =
batches taken before this one, the real sample ids, ``batch.info``, ``sync_gradients`` and
``end_of_dataloader`` as ``accumulate()`` saw them), ``epoch_start`` (``len(loader)``,
``loader.remaining()``), ``saved``, ``killed`` and at the end ``end`` (per-worker traces, rebuilds
and restarts, a digest of the weights). A state saved at global step K (``step-K``) holds every
batch logged with ``global_step < K``. ``--kill-at-step K`` SIGKILLs every process right after the
state of step K is saved, as a crash.
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

from loader import Loader, SamplesDataset, ndd

FEATURES = 8
CLASSES = 3


# ------------------------------------------------------------------ data: runs in the workers


def make_sample(index: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Sample ``index``: a float vector drawn from the id, and the id itself."""
    features = np.random.default_rng([7, index]).standard_normal(FEATURES).astype(np.float32)
    return features, np.array([index], dtype=np.int64)


def feature_step(features: Any, ids: Any) -> dict[str, Any]:
    return {"x": ndd.cast(features, dtype=ndd.float32), "id": ndd.cast(ids, dtype=ndd.int64)}


# ------------------------------------------------------------------ the trainer's side


class Progress:
    """Batches taken over all runs; saved with the rest by ``save_state``."""

    def __init__(self) -> None:
        self.global_step = 0

    def state_dict(self) -> dict[str, int]:
        return {"global_step": self.global_step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.global_step = int(state["global_step"])


class JsonLog:
    """Appends one JSON line per record; every line is one ``write`` to a file opened for
    appending, so the processes of a job can share the file."""

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


def weights_digest(module: Any) -> str:
    """A fingerprint of the weights, to compare runs."""
    digest = hashlib.sha256()
    for tensor in module.state_dict().values():
        digest.update(tensor.detach().cpu().numpy().tobytes())
    return digest.hexdigest()


def train(args: argparse.Namespace, log: JsonLog) -> None:
    import torch
    import torch.nn.functional as F
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.accumulate)
    rank, world = accelerator.process_index, accelerator.num_processes
    torch.manual_seed(args.seed)
    net = torch.nn.Linear(FEATURES, CLASSES)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = accelerator.prepare(net, optimizer)
    progress = Progress()
    with Loader(
        SamplesDataset(args.samples, make_sample, num_outputs=2),  # each sample once an epoch
        feature_step,
        batch_size=args.batch_size,
        num_workers=args.workers,
        output="torch",
        seed=args.seed,
    ) as loader:
        accelerator.register_for_checkpointing(loader, progress)
        if args.resume is not None:
            accelerator.load_state(str(args.resume))  # before the first iter(loader)
        for epoch in range(loader.epoch, args.epochs):
            log.write(
                event="epoch_start",
                rank=rank,
                epoch=epoch,
                len=len(loader),
                remaining=loader.remaining(),
            )
            for batch in loader:
                inputs, ids = batch["x"], batch["id"].reshape(-1)
                with accelerator.accumulate(model):
                    loss = F.cross_entropy(model(inputs), ids % CLASSES)
                    accelerator.backward(loss)
                    optimizer.step()  # a no-op until the accumulation steps are done
                    optimizer.zero_grad()
                info = batch.info
                log.write(
                    event="step",
                    rank=rank,
                    world_size=world,
                    epoch=epoch,
                    global_step=progress.global_step,
                    ids=ids[: len(ids) - info.padded].tolist(),
                    padded=info.padded,
                    info=dataclasses.asdict(info),
                    sync_gradients=accelerator.sync_gradients,
                    end_of_dataloader=accelerator.gradient_state.end_of_dataloader,
                )
                progress.global_step += 1
                del batch, inputs, ids
                if args.save_every and progress.global_step % args.save_every == 0:
                    path = args.ckpt_dir / f"step-{progress.global_step:03d}"
                    accelerator.save_state(str(path))
                    accelerator.wait_for_everyone()  # every file is written
                    log.write(event="saved", rank=rank, global_step=progress.global_step)
                    if progress.global_step == args.kill_at_step:
                        log.write(event="killed", rank=rank, global_step=progress.global_step)
                        # every rank's record is written before the first dies (the launcher
                        # then stops the others with SIGTERM)
                        accelerator.wait_for_everyone()
                        os.kill(os.getpid(), signal.SIGKILL)
        log.write(
            event="end",
            rank=rank,
            world_size=world,
            global_step=progress.global_step,
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
            weights=weights_digest(accelerator.unwrap_model(model)),
        )
    accelerator.end_training()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=96, help="synthetic samples")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--workers", type=int, default=1, help="loader workers per process")
    parser.add_argument("--accumulate", type=int, default=1, help="gradient accumulation steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-every", type=int, default=0, help="save_state every N batches")
    parser.add_argument("--ckpt-dir", type=Path, default=Path("checkpoints"))
    parser.add_argument("--resume", type=Path, default=None, help="a save_state folder")
    parser.add_argument("--log", type=Path, default=None, help="append JSON lines here")
    parser.add_argument(
        "--kill-at-step",
        type=int,
        default=None,
        help="SIGKILL every process right after the state of this global step is saved",
    )
    args = parser.parse_args()
    train(args, JsonLog(args.log))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
