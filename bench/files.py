"""``sharded_files`` next to DALI's file reader: ``python -m bench.files [--pairs N]``.

The images workload (decode, random resized crop 224, flip, normalize; batches of 64; the 512
sample images) through the loader, W=2, capture, once over ``ndd.readers.File`` and once over
``sharded_files``. A 3% target is below this shared machine's run-to-run noise, so the two run
as alternated pairs (which one goes first alternates too), and the table shows every pair's
ratio and their median. Per contender: batches/s over the timed epochs, the workers' CPU per
batch (every worker process, all threads) and the median time from ``iter(loader)`` to an
epoch's first batch.
"""

from __future__ import annotations

import argparse
import functools
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil

from bench import _harness as H
from bench import _sources as S
from loader import Loader, ensure_sample_dataset
from loader.sample import image_source, image_step

BATCH = 64
WORKERS = 2


@dataclass
class Run:
    batches_per_second: float
    worker_cpu_ms: float  # per batch, all worker processes and threads
    first_batch_ms: float  # median over the timed epochs


def measure(source: Callable[..., Any], epochs: int, threads: int) -> Run:
    with Loader(
        source,
        image_step,
        batch_size=BATCH,
        num_workers=WORKERS,
        num_threads=max(1, threads // WORKERS),
    ) as loader:
        for batch in loader:  # the traced epoch is not timed
            del batch
        workers = [psutil.Process(pid) for pid in loader.worker_pids()]
        cpu = H.process_cpu(workers)
        count = 0
        firsts: list[float] = []
        with H.Clock() as clock:
            for _ in range(epochs):
                with H.Clock() as epoch:
                    first = None
                    for batch in loader:
                        if first is None:
                            first = epoch.lap()
                        count += 1
                        del batch
                firsts.append(first or 0.0)
        cpu = H.process_cpu(workers) - cpu
    return Run(count / clock.wall, 1e3 * cpu / count, 1e3 * statistics.median(firsts))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pairs", type=int, default=10, help="alternated reader/files pairs")
    parser.add_argument("--epochs", type=int, default=8, help="timed epochs per run")
    H.add_threads(parser)


def parser() -> argparse.ArgumentParser:
    return H.parser("files", __doc__, add_arguments)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    threads = H.threads(args.threads)
    root = str(ensure_sample_dataset())
    sources = {  # the first pair starts with sharded_files
        "sharded_files": functools.partial(S.files_source, root=root, batch_size=BATCH),
        "readers.File": functools.partial(image_source, root=root, batch_size=BATCH),
    }
    found = H.paired(
        {
            name: functools.partial(measure, source, args.epochs, threads)
            for name, source in sources.items()
        },
        rounds=args.pairs,
    )
    H.print_table(
        [
            H.Col("pair"),
            H.Col("contender", left=True),
            H.Col("batches/s", ".2f"),
            H.Col("worker CPU ms/batch", ".1f"),
            H.Col("1st batch of epoch ms", ".0f"),
        ],
        [
            (
                t.round,
                name,
                t.value.batches_per_second,
                t.value.worker_cpu_ms,
                t.value.first_batch_ms,
            )
            for name, t in H.in_order(found)
        ],
    )
    ratios = H.ratios(found, "sharded_files", "readers.File", lambda run: run.batches_per_second)
    H.print_ratios("sharded_files / readers.File", ratios, 0.97)


if __name__ == "__main__":
    main()
