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
import time
from pathlib import Path
from typing import Any

import numpy as np

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
    started = time.perf_counter()
    for _ in range(count):
        np.copyto(target, source)
    return (time.perf_counter() - started) / count


def time_loader(shape: tuple[int, ...], dtype: str, batch_size: int, count: int) -> float:
    source = functools.partial(
        repeat_source, shape=shape, dtype=dtype, batch_size=batch_size, count=count + 10
    )
    with Loader(source, identity_step, batch_size=batch_size, num_workers=1, capture=False) as lo:
        iterator = iter(lo)
        for _ in range(10):  # warm up: arena creation, first faults
            del _
            next(iterator)
        started = time.perf_counter()
        cpu_started = time.process_time()
        n = 0
        for batch in iterator:
            n += 1
            del batch
        TRAINER_CPU.append((time.process_time() - cpu_started) / n)
        return (time.perf_counter() - started) / n


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
    started = time.perf_counter()
    n = 0
    for batch in iterator:
        n += 1
        del batch
    elapsed = (time.perf_counter() - started) / n
    del iterator
    return elapsed


def run(repeats: int, count_large: int, count_tiny: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, (shape, dtype, batch_size) in CASES.items():
        count = count_large if name == "large" else count_tiny
        rows: dict[str, list[float]] = {"memcpy": [], "loader": [], "torch DataLoader": []}
        for _ in range(repeats):
            rows["memcpy"].append(time_memcpy(shape, dtype, batch_size, count))
            rows["loader"].append(time_loader(shape, dtype, batch_size, count))
            torch_time = time_torch(shape, dtype, batch_size, count)
            if torch_time is not None:
                rows["torch DataLoader"].append(torch_time)
        nbytes = int(np.prod((batch_size, *shape))) * np.dtype(dtype).itemsize
        results[name] = {
            "bytes": nbytes,
            "seconds_per_batch": {k: statistics.median(v) for k, v in rows.items() if v},
            "loader_trainer_cpu_per_batch": statistics.median(TRAINER_CPU),
        }
        TRAINER_CPU.clear()
    return results


def render(results: dict[str, Any]) -> str:
    lines = [
        f"{'batch':<6} {'contender':<18} {'per batch':>12} {'GB/s':>8} {'vs memcpy':>10}",
    ]
    for name, result in results.items():
        floor = result["seconds_per_batch"]["memcpy"]
        for contender, seconds in result["seconds_per_batch"].items():
            rate = result["bytes"] / seconds / 1e9
            per = f"{seconds * 1e6:.1f} us" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"
            lines.append(
                f"{name:<6} {contender:<18} {per:>12} {rate:>8.2f} {seconds / floor:>9.2f}x"
            )
    lines.append("")
    for name, result in results.items():
        cpu = result["loader_trainer_cpu_per_batch"] * 1e6
        lines.append(f"loader trainer-side CPU per {name} batch: {cpu:.1f} us")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--large", type=int, default=60, help="batches per large run")
    parser.add_argument("--tiny", type=int, default=3000, help="batches per tiny run")
    args = parser.parse_args()
    results = run(args.repeats, args.large, args.tiny)
    print(render(results))
    out = Path(__file__).parent / "results" / "transport.json"
    out.write_text(json.dumps(results, indent=2))
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
