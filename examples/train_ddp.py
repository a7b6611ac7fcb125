"""DDP training fed by one dali-capture-loader per rank.

    torchrun --standalone --nproc_per_node=2 examples/train_ddp.py

Each rank runs ``--workers`` worker processes; shard ``rank * workers + worker`` of
``world_size * workers`` reads its part of one seeded permutation per epoch, so every epoch covers
the dataset exactly once across ranks and every rank takes the same number of steps. With
``--out DIR`` each rank writes what it saw (sample ids without padding, steps per epoch) to
``DIR/rank<R>.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import nvidia.dali.experimental.dynamic as ndd
import torch
import torch.distributed as dist
import torch.nn.functional as F

from loader import Loader, Shard, ensure_sample_dataset, list_images, sharded_source


def read_sample(files: list[str], index: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    return np.fromfile(files[index], dtype=np.uint8), np.array([index], dtype=np.int64)


def source(shard: Shard, root: str, batch_size: int) -> Any:
    files, _labels = list_images(root)
    load = functools.partial(read_sample, files)
    return sharded_source(shard, len(files), load, batch_size, num_outputs=2, shuffle=True)


def step(jpegs: Any, ids: Any) -> dict[str, Any]:
    images = ndd.decoders.image(jpegs, device="cpu")
    images = ndd.resize(images, size=[32, 32])
    images = ndd.crop_mirror_normalize(images, dtype=ndd.float32, mean=[128.0] * 3, std=[64.0] * 3)
    return {"image": images, "id": ids}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=None, help="ImageFolder; default: samples")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
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
    root = str(args.data or ensure_sample_dataset())

    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, stride=2),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(8, 10),
    )
    model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    record: dict[str, Any] = {"rank": rank, "world_size": world, "epochs": []}
    with Loader(
        functools.partial(source, root=root, batch_size=batch_size),
        step,
        batch_size=batch_size,
        num_workers=args.workers,
        output="torch",
    ) as loader:
        for epoch in range(args.epochs):
            seen: list[int] = []
            steps = 0
            for batch in loader:
                images, ids = batch["image"], batch["id"].squeeze(1)
                loss = F.cross_entropy(model(images), ids % 10)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                seen += ids[: len(ids) - batch.info.padded].tolist()
                steps += 1
                del batch, images, ids
            record["epochs"].append({"epoch": epoch, "steps": steps, "ids": seen})
            if rank == 0:
                print(f"epoch {epoch}: {steps} steps per rank, loss {loss.item():.3f}", flush=True)
        record["len"] = len(loader)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
