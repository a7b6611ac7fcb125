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
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil

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


def _cpu(processes: list[psutil.Process]) -> float:
    return sum(p.cpu_times().user + p.cpu_times().system for p in processes)


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
        cpu = _cpu(workers)
        started = time.perf_counter()
        count = 0
        firsts: list[float] = []
        for _ in range(epochs):
            epoch_started = time.perf_counter()
            first = None
            for batch in loader:
                if first is None:
                    first = time.perf_counter() - epoch_started
                count += 1
                del batch
            firsts.append(first or 0.0)
        elapsed = time.perf_counter() - started
        cpu = _cpu(workers) - cpu
    return Run(count / elapsed, 1e3 * cpu / count, 1e3 * statistics.median(firsts))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.files", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--pairs", type=int, default=10, help="alternated reader/files pairs")
    parser.add_argument("--epochs", type=int, default=8, help="timed epochs per run")
    parser.add_argument("--threads", type=int, default=None, help="total DALI threads (CPUs)")
    args = parser.parse_args(argv)
    threads = args.threads or len(os.sched_getaffinity(0))
    root = str(ensure_sample_dataset())
    contenders = {
        "readers.File": functools.partial(image_source, root=root, batch_size=BATCH),
        "sharded_files": functools.partial(S.files_source, root=root, batch_size=BATCH),
    }
    print(
        f"{'pair':>4} {'contender':<14} {'batches/s':>9} {'worker CPU ms/batch':>19} "
        f"{'1st batch of epoch ms':>21}"
    )
    ratios = []
    for pair in range(args.pairs):
        names = list(contenders) if pair % 2 else list(reversed(contenders))
        runs = {}
        for name in names:
            run = runs[name] = measure(contenders[name], args.epochs, threads)
            print(
                f"{pair:>4} {name:<14} {run.batches_per_second:>9.2f} "
                f"{run.worker_cpu_ms:>19.1f} {run.first_batch_ms:>21.0f}",
                flush=True,
            )
        ratios.append(
            runs["sharded_files"].batches_per_second / runs["readers.File"].batches_per_second
        )
    median = statistics.median(ratios)
    print(f"sharded_files / readers.File per pair: {' '.join(f'{r:.2f}' for r in ratios)}")
    print(
        f"median {median:.3f} (range {min(ratios):.2f}-{max(ratios):.2f}); target >= 0.97: "
        f"{'met' if median >= 0.97 else 'MISSED'}"
    )


if __name__ == "__main__":
    main()
