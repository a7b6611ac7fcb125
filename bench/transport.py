"""Worker -> trainer transport, side by side in one run: ``python -m bench.transport``.

For a large batch (64x3x224x224 float32, 38.5 MB) and a tiny one (4 samples of 4x4 uint8):

(a) one ``memcpy`` of the batch's bytes in this process: the floor;
(b) this loader: one worker whose loop hands the same prebuilt DALI batch to ``step`` (eager, so
    DALI copies nothing) and whose transport copies it into a shared-memory slot, sends the
    descriptor, and the trainer builds the views and releases the slot. Measured as steady-state
    time per batch in the trainer;
(c) ``torch.utils.data.DataLoader`` with one worker returning the same tensor (its shared-memory
    path: the tensor is copied into shared memory and its fd sent per batch).

Medians of several repeats; ratios against (a).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from bench import _harness as H
from bench._sources import RepeatDataset, identity_step, repeat_source
from loader import Loader

CASES = {
    "large": ((3, 224, 224), "float32", 64),
    "tiny": ((4, 4), "uint8", 4),
}


def time_memcpy(shape: tuple[int, ...], dtype: str, batch_size: int, count: int) -> float:
    source = np.random.default_rng(0).random((batch_size, *shape)).astype(dtype)
    target = np.empty_like(source)
    np.copyto(target, source)
    with H.Clock() as clock:
        for _ in range(count):
            np.copyto(target, source)
    return clock.wall / count


def time_loader(shape: tuple[int, ...], dtype: str, batch_size: int, count: int) -> float:
    source = functools.partial(
        repeat_source, shape=shape, dtype=dtype, batch_size=batch_size, count=count + 10
    )
    with Loader(source, identity_step, batch_size=batch_size, num_workers=1, capture=False) as lo:
        iterator = iter(lo)
        for _ in range(10):  # warm up: arena creation, first faults
            del _
            next(iterator)
        n = 0
        with H.Clock() as clock:
            for batch in iterator:
                n += 1
                del batch
        TRAINER_CPU.append(clock.cpu / n)
        return clock.wall / n


TRAINER_CPU: list[float] = []


def time_torch(shape: tuple[int, ...], dtype: str, batch_size: int, count: int) -> float | None:
    try:
        import torch.utils.data
    except ImportError:
        return None
    dataset = RepeatDataset(shape, dtype, batch_size, count + 10)
    data = torch.utils.data.DataLoader(
        dataset, batch_size=None, num_workers=1, prefetch_factor=2, multiprocessing_context="spawn"
    )
    iterator = iter(data)
    for _ in range(10):
        next(iterator)
    n = 0
    with H.Clock() as clock:
        for batch in iterator:
            n += 1
            del batch
    del iterator
    return clock.wall / n


def run(repeats: int, count_large: int, count_tiny: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, (shape, dtype, batch_size) in CASES.items():
        count = count_large if name == "large" else count_tiny
        case = (shape, dtype, batch_size, count)
        found = H.paired(
            {
                "memcpy": functools.partial(time_memcpy, *case),
                "loader": functools.partial(time_loader, *case),
                "torch DataLoader": functools.partial(time_torch, *case),
            },
            rounds=repeats,
            order="fixed",
        )
        rows = {k: [t.value for t in v if t.value is not None] for k, v in found.items()}
        nbytes = int(np.prod((batch_size, *shape))) * np.dtype(dtype).itemsize
        results[name] = {
            "bytes": nbytes,
            "seconds_per_batch": {k: statistics.median(v) for k, v in rows.items() if v},
            "loader_trainer_cpu_per_batch": statistics.median(TRAINER_CPU),
        }
        TRAINER_CPU.clear()
    return results


def render(results: dict[str, Any]) -> str:
    rows = []
    for name, result in results.items():
        floor = result["seconds_per_batch"]["memcpy"]
        for contender, seconds in result["seconds_per_batch"].items():
            rate = result["bytes"] / seconds / 1e9
            per = f"{seconds * 1e6:.1f} us" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"
            rows.append((name, contender, per, rate, H.ratio(seconds, floor)))
    columns = [
        H.Col("batch", left=True),
        H.Col("contender", left=True),
        H.Col("per batch"),
        H.Col("GB/s", ".2f"),
        H.Col("vs memcpy"),
    ]
    lines = [H.table(columns, rows), ""]
    for name, result in results.items():
        cpu = result["loader_trainer_cpu_per_batch"] * 1e6
        lines.append(f"loader trainer-side CPU per {name} batch: {cpu:.1f} us")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--large", type=int, default=60, help="batches per large run")
    parser.add_argument("--tiny", type=int, default=3000, help="batches per tiny run")


def parser() -> argparse.ArgumentParser:
    return H.parser("transport", __doc__, add_arguments)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    results = run(args.repeats, args.large, args.tiny)
    print(render(results))
    out = Path(__file__).parent / "results" / "transport.json"
    out.write_text(json.dumps(results, indent=2))
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
