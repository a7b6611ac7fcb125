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
from dataclasses import dataclass

import psutil

from bench import _harness as H
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
        batches = 0
        with H.Clock() as clock:
            for _ in range(epochs):
                for batch in loader:
                    batches += 1
                    del batch
        elapsed = clock.wall
        memory = [psutil.Process(pid).memory_full_info() for pid in loader.worker_pids()]
    return Run(
        batches / elapsed,
        statistics.mean(m.rss for m in memory) / MIB,
        statistics.mean(m.uss for m in memory) / MIB,
        statistics.mean(m.pss for m in memory) / MIB,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pairs", type=int, default=3, help="alternated default/spawn pairs")
    parser.add_argument("--epochs", type=int, default=2, help="timed epochs per run")


def parser() -> argparse.ArgumentParser:
    return H.parser("forked", __doc__, add_arguments)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    root = str(ensure_sample_dataset())
    found = H.paired(
        {
            "default (forked)": functools.partial(measure, root, None, args.epochs),
            "spawn": functools.partial(measure, root, "spawn", args.epochs),
        },
        rounds=args.pairs,
    )
    runs = {name: [t.value for t in made] for name, made in found.items()}
    ratios = H.ratios(found, "default (forked)", "spawn", lambda run: run.batches_per_second)
    print(f"images, W={WORKERS}, batch {BATCH}, {args.epochs} timed epochs per run")
    H.print_table(
        [
            H.Col("start method", left=True),
            H.Col("batches/s", ".2f"),
            H.Col("runs"),
            H.Col("worker RSS MiB", ".0f"),
            H.Col("USS MiB", ".0f"),
            H.Col("PSS MiB", ".0f"),
        ],
        [
            (
                name,
                statistics.median(v.batches_per_second for v in values),
                H.runs((v.batches_per_second for v in values), ".1f"),
                statistics.median(v.rss for v in values),
                statistics.median(v.uss for v in values),
                statistics.median(v.pss for v in values),
            )
            for name, values in runs.items()
        ],
    )
    print(f"default / spawn per pair: {H.runs(ratios)}; median {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
