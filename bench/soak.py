"""Soak: many epochs of sample ids through the loader; nothing lost, nothing twice, flat memory.

``python -m bench.soak`` runs ``--epochs`` epochs of ``--batches`` batches (over all workers) of
sample ids with a shuffled, exactly-once ``sharded_source``, checks every epoch, and prints the
resident memory of the trainer and each worker after the first and the last epoch. It also times
``close()`` of an 8-worker loader.
"""

from __future__ import annotations

import argparse
import functools

import numpy as np
import psutil

from bench import _harness as H
from bench._sources import soak_source, soak_step
from loader import Loader


def rss_mib(pids: list[int]) -> list[float]:
    return [psutil.Process(pid).memory_info().rss / 2**20 for pid in pids]


def soak(epochs: int, batches: int, batch_size: int, workers: int) -> bool:
    total = batches * batch_size
    source = functools.partial(soak_source, total=total, batch_size=batch_size)
    ok = True
    with Loader(source, soak_step, batch_size=batch_size, num_workers=workers, seed=5) as loader:
        pids = loader.worker_pids()
        first: list[float] = []
        rows = []
        with H.Clock() as whole:
            for epoch in range(epochs):
                with H.Clock() as clock:
                    seen, lost, duplicated, padded = _epoch(loader, total)
                ok &= lost == 0 and duplicated == 0
                rows.append((epoch, seen, lost, duplicated, padded, clock.wall))
                if epoch == 0:
                    first = rss_mib([psutil.Process().pid, *pids])
            last = rss_mib([psutil.Process().pid, *pids])
    H.print_table(
        [H.Col(name) for name in ("epoch", "batches", "lost", "dup", "padded")]
        + [H.Col("seconds", ".2f")],
        rows,
    )
    print(f"\n{epochs * batches} batches in {whole.wall:.1f} s")
    names = ["trainer"] + [f"worker {i}" for i in range(workers)]
    H.print_table(
        [
            H.Col("process", left=True),
            H.Col("RSS after epoch 0", ".1f", " MiB"),
            H.Col("RSS after last", ".1f", " MiB"),
            H.Col("change", "+.1f"),
        ],
        [(name, a, b, b - a) for name, a, b in zip(names, first, last, strict=True)],
    )
    return ok


def _epoch(loader: Loader, total: int) -> tuple[int, int, int, int]:
    """One epoch of sample ids: batches seen, ids lost, ids seen twice, padded samples."""
    counts = np.zeros(total, dtype=np.int64)
    padded = 0
    seen = 0
    for batch in loader:
        ids = np.asarray(batch["id"]).ravel()
        real = len(ids) - batch.info.padded
        np.add.at(counts, ids[:real], 1)
        padded += batch.info.padded
        seen += 1
        del batch, ids
    return seen, int((counts == 0).sum()), int((counts > 1).sum()), padded


def time_close(workers: int, repeats: int) -> list[float]:
    source = functools.partial(soak_source, total=workers * 8, batch_size=4)
    times = []
    for _ in range(repeats):
        loader = Loader(source, soak_step, batch_size=4, num_workers=workers, num_threads=1)
        next(iter(loader))
        with H.Clock() as clock:
            loader.close()
        times.append(clock.wall)
    return times


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batches", type=int, default=3000, help="batches per epoch, all workers")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)


def parser() -> argparse.ArgumentParser:
    return H.parser("soak", __doc__, add_arguments)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    ok = soak(args.epochs, args.batches, args.batch_size, args.workers)
    closes = time_close(8, 3)
    print(f"\nclose() of 8 workers: {', '.join(f'{t * 1000:.0f} ms' for t in closes)}")
    print("\nPASS: no sample lost or duplicated" if ok else "\nFAIL: samples lost or duplicated")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
