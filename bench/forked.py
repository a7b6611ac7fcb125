"""Forked workers next to spawned ones, on the images workload: ``python -m bench.forked``.

The loader with W=2 (capture, one DALI thread each; decode, random resized crop 224, flip,
normalize; batches of 64 over the 512 sample images) built with the default start method (the
worker server: workers forked from it) and with ``start_method="spawn"``, as alternated pairs (the
order alternates too). Per run: batches/s over the timed epochs, and each worker's memory after
them: RSS, USS (pages only it holds) and PSS (its share of pages it shares), from
``/proc/<pid>/smaps_rollup`` through psutil. Forked workers share the server's pages (DALI, the
script's imports) until either writes them, so their USS should be lower than a spawned
worker's, and throughput the same.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from dataclasses import dataclass

import psutil

from loader import Loader, ensure_sample_dataset
from loader.sample import image_source, image_step

BATCH = 64
WORKERS = 2
MIB = 1 << 20


@dataclass(frozen=True)
class Run:
    batches_per_second: float
    rss: float  # MiB per worker, mean
    uss: float
    pss: float


def measure(root: str, start_method: str | None, epochs: int) -> Run:
    source = functools.partial(image_source, root=root, batch_size=BATCH)
    with Loader(
        source,
        image_step,
        batch_size=BATCH,
        num_workers=WORKERS,
        num_threads=1,
        start_method=start_method,
    ) as loader:
        for batch in loader:  # warm-up epoch: start, trace
            del batch
        started, batches = time.perf_counter(), 0
        for _ in range(epochs):
            for batch in loader:
                batches += 1
                del batch
        elapsed = time.perf_counter() - started
        memory = [psutil.Process(pid).memory_full_info() for pid in loader.worker_pids()]
    return Run(
        batches / elapsed,
        statistics.mean(m.rss for m in memory) / MIB,
        statistics.mean(m.uss for m in memory) / MIB,
        statistics.mean(m.pss for m in memory) / MIB,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3, help="alternated default/spawn pairs")
    parser.add_argument("--epochs", type=int, default=2, help="timed epochs per run")
    args = parser.parse_args()
    root = str(ensure_sample_dataset())
    runs: dict[str, list[Run]] = {"default (forked)": [], "spawn": []}
    ratios = []
    for pair in range(args.pairs):
        order = [None, "spawn"] if pair % 2 == 0 else ["spawn", None]
        found = {method: measure(root, method, args.epochs) for method in order}
        runs["default (forked)"].append(found[None])
        runs["spawn"].append(found["spawn"])
        ratios.append(found[None].batches_per_second / found["spawn"].batches_per_second)
    print(f"images, W={WORKERS}, batch {BATCH}, {args.epochs} timed epochs per run")
    print(
        f"{'start method':<17} {'batches/s':>9} {'runs':>20} {'worker RSS MiB':>15} "
        f"{'USS MiB':>8} {'PSS MiB':>8}"
    )
    for name, values in runs.items():
        rates = " ".join(f"{v.batches_per_second:.1f}" for v in values)
        print(
            f"{name:<17} {statistics.median(v.batches_per_second for v in values):>9.2f} "
            f"{rates:>20} {statistics.median(v.rss for v in values):>15.0f} "
            f"{statistics.median(v.uss for v in values):>8.0f} "
            f"{statistics.median(v.pss for v in values):>8.0f}"
        )
    pairs = " ".join(f"{r:.2f}" for r in ratios)
    print(f"default / spawn per pair: {pairs}; median {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
