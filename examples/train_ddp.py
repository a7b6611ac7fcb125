"""DDP training fed by one dali-capture-loader per rank, with checkpoints that resume mid-epoch.

    torchrun --standalone --nproc_per_node=2 examples/train_ddp.py --save-every 20
    torchrun --standalone --nproc_per_node=1 examples/train_ddp.py --resume checkpoint.pt

Each rank runs ``--workers`` worker processes; shard ``rank * workers + worker`` of
``world_size * workers`` reads its part of one seeded permutation per epoch, so every epoch covers
the dataset exactly once across ranks and every rank takes the same number of steps.

Every ``--save-every`` steps each rank calls ``loader.state_dict()`` (a collective: every rank at
the same step, every rank gets the same dict) and rank 0 writes the model, the optimizer, the
loader state and the step to ``--checkpoint``, atomically. ``--resume`` loads such a checkpoint on
every rank before the first ``iter(loader)``: the interrupted epoch goes on with the batches not
yet received, on the same layout (the same stream as without the interruption) or on another
world size or worker count (the rest of the epoch split evenly among the new ranks).

With ``--augment`` the step crops and flips at random (DALI's ``random_resized_crop`` and a
``coin_flip`` mirror): a resume on the same layout gives the same bytes all the same, as the
loader's state carries each worker's random generator states.

With ``--tars 'DIR/train-{000000..000009}.tar'`` the data are WebDataset shards (local paths or
``s3://`` URLs), read by ``TarsDataset``: each sample's ``.jpg``, and its ``.id`` member (the
sample's number, which the records below name) or, where it has none (shards written by
``python -m loader.tars write``), its ``.cls`` label in its place. ``--shuffle-window K``
shuffles them ``K`` shards at a time, as remote shards are by default.

Under ``torchrun --max-restarts N``, ``--resume auto`` resumes every restarted attempt from the
newest checkpoint (``--checkpoint``, written atomically) and starts the first afresh;
``--die-at K`` makes the last rank crash at step ``K`` in the first attempt. Set
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: without it torch hangs or fails in gloo's
``connectFullMesh`` when it restarts the ranks (with or without the loader)::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node=2 \
        --max-restarts 1 examples/train_ddp.py --save-every 5 --resume auto

With ``--out DIR`` each rank writes what it saw in this run (per epoch: sample ids without
padding, a digest of each batch's images, steps) to ``DIR/rank<R>.json`` (a restarted attempt
``K``: ``DIR/rank<R>.restart<K>.json``), at every checkpoint and at the end.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from loader import (
    Loader,
    SamplesDataset,
    TarsDataset,
    ensure_sample_dataset,
    list_images,
    ndd,
)


def read_sample(files: list[str], index: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    return np.fromfile(files[index], dtype=np.uint8), np.array([index], dtype=np.int64)


def image_dataset(root: str) -> SamplesDataset:
    """An ImageFolder's files as (JPEG bytes, id): each once per epoch, shuffled."""
    files, _labels = list_images(root)
    return SamplesDataset(len(files), functools.partial(read_sample, files), num_outputs=2)


def tar_dataset(urls: str, window: int | None) -> TarsDataset:
    """WebDataset shards as (JPEG bytes, id, or the label where a sample has no id)."""
    return TarsDataset(urls, ext=("jpg", "id;cls"), shuffle_window=window)


def step(jpegs: Any, ids: Any) -> dict[str, Any]:
    images = ndd.decoders.image(jpegs, device="cpu")
    images = ndd.resize(images, size=[32, 32])
    images = ndd.crop_mirror_normalize(images, dtype=ndd.float32, mean=[128.0] * 3, std=[64.0] * 3)
    return {"image": images, "id": ids}


def augment_step(jpegs: Any, ids: Any) -> dict[str, Any]:
    images = ndd.decoders.image(jpegs, device="cpu")
    images = ndd.random_resized_crop(images, size=[32, 32])
    flip = ndd.random.coin_flip(probability=0.5, batch_size=images.batch_size)  # per sample
    images = ndd.crop_mirror_normalize(
        images, dtype=ndd.float32, mirror=flip, mean=[128.0] * 3, std=[64.0] * 3
    )
    return {"image": images, "id": ids}


def write_atomically(path: Path, write: Callable[[IO[bytes]], Any]) -> None:
    """Write ``path`` through a temporary file and ``os.replace``: a crash at any moment leaves
    either the previous file or the new one, never half of one."""
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "wb") as file:
        write(file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


def weights_digest(model: torch.nn.Module) -> str:
    """A fingerprint of the weights, to compare runs."""
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().cpu().numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=None, help="ImageFolder; default: samples")
    parser.add_argument(
        "--tars", default=None, help="WebDataset shards (.jpg, .id or .cls) instead of --data"
    )
    parser.add_argument(
        "--shuffle-window", type=int, default=None, help="--tars: shards shuffled together"
    )
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--augment", action="store_true", help="random crops and flips")
    parser.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps")
    parser.add_argument("--checkpoint", type=Path, default=Path("checkpoint.pt"))
    parser.add_argument(
        "--resume",
        default=None,
        help="a checkpoint to resume from, or 'auto': --checkpoint if it exists (the newest "
        "complete one: it is written atomically), else a fresh start (for torchrun restarts)",
    )
    parser.add_argument(
        "--die-at",
        type=int,
        default=None,
        help="at this step the last rank exits with code 1, in torchrun's first attempt only "
        "(TORCHELASTIC_RESTART_COUNT 0): a crash for --max-restarts to restart",
    )
    parser.add_argument(
        "--stop-after",
        type=int,
        default=None,
        help="after N steps (counted from the start of training), stop making progress and wait "
        "to be killed (to try resuming from a real crash)",
    )
    parser.add_argument(
        "--max-restarts", type=int, default=0, help="dead or stuck workers each rank may replace"
    )
    parser.add_argument(
        "--kill-worker-at",
        type=int,
        default=None,
        help="at this step, the last rank SIGKILLs its last worker (to see healing)",
    )
    parser.add_argument(
        "--batch-size-on-rank",
        default=None,
        help="R=B: rank R uses batch size B (to see the cross-rank agreement check fail)",
    )
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    batch_size = args.batch_size
    if args.batch_size_on_rank:
        odd_rank, odd_size = (int(v) for v in args.batch_size_on_rank.split("="))
        if rank == odd_rank:
            batch_size = odd_size
    root = "" if args.tars is not None else str(args.data or ensure_sample_dataset())

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, stride=2),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(8, 10),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    checkpoint = None
    global_step = 0  # steps taken since the start of training, over all runs
    resume = args.resume
    if resume == "auto":
        resume = args.checkpoint if args.checkpoint.exists() else None
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if resume is not None:
        checkpoint = torch.load(resume, map_location="cpu")
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        global_step = checkpoint["step"]
    ddp_model = torch.nn.parallel.DistributedDataParallel(model)

    record: dict[str, Any] = {
        "rank": rank,
        "world_size": world,
        "workers": args.workers,
        "resumed_from": global_step if checkpoint is not None else None,
        "attempt": attempt,
        "epochs": [],
    }

    def save_record() -> None:
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            text = json.dumps(record).encode()
            name = f"rank{rank}.json" if attempt == 0 else f"rank{rank}.restart{attempt}.json"
            write_atomically(args.out / name, lambda file: file.write(text))

    if args.tars is not None:
        dataset: SamplesDataset | TarsDataset = tar_dataset(args.tars, args.shuffle_window)
    else:
        dataset = image_dataset(root)
    with Loader(
        dataset,
        augment_step if args.augment else step,
        batch_size=batch_size,
        num_workers=args.workers,
        output="torch",
        max_restarts=args.max_restarts,
    ) as loader:
        if checkpoint is not None:
            loader.load_state_dict(checkpoint["loader"])  # before the first iter(loader)
        for epoch in range(loader.epoch, args.epochs):
            seen: list[int] = []
            digests: list[str] = []
            progress: dict[str, Any] = {
                "epoch": epoch,
                "len": len(loader),  # the epoch's length, also in a resumed epoch
                "remaining": loader.remaining(),  # what this run takes of it
                "steps": 0,
                "ids": seen,
                "digests": digests,
            }
            record["epochs"].append(progress)
            for batch in loader:
                images, ids = batch["image"], batch["id"].squeeze(1)
                loss = F.cross_entropy(ddp_model(images), ids % 10)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                seen += ids[: len(ids) - batch.info.padded].tolist()
                digests.append(hashlib.sha256(images.numpy().tobytes()).hexdigest()[:16])
                progress["steps"] += 1
                global_step += 1
                del batch, images, ids

                if args.save_every and global_step % args.save_every == 0:
                    state = {
                        "step": global_step,
                        "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "loader": loader.state_dict(),  # every rank calls it, at the same step
                    }
                    if rank == 0:
                        write_atomically(args.checkpoint, functools.partial(torch.save, state))
                        print(f"step {global_step}: saved {args.checkpoint}", flush=True)
                    record["step"] = global_step
                    save_record()
                if global_step == args.kill_worker_at and rank == world - 1:
                    # the last worker: it has the most batches of the epoch still to make
                    os.kill(loader.worker_pids()[-1], signal.SIGKILL)
                if global_step == args.die_at and rank == world - 1 and attempt == 0:
                    print(f"rank {rank} dies at step {global_step}", flush=True)
                    os._exit(1)  # a crash: no cleanup, the loader's workers follow
                if global_step == args.stop_after:
                    dist.barrier()  # every rank is done with its steps (and checkpoint) so far
                    if rank == 0:
                        print(f"stopped after step {global_step}; waiting to be killed", flush=True)
                    while True:
                        time.sleep(1)
            if rank == 0 and progress["steps"]:
                steps = progress["steps"]
                print(f"epoch {epoch}: {steps} steps, loss {loss.item():.3f}", flush=True)
        record["restarts"] = loader.stats().restarts
    record["step"] = global_step
    record["weights"] = weights_digest(model)
    save_record()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
