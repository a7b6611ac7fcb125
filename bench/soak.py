"""Soak: many epochs of sample ids through the loader; nothing lost, nothing twice, flat memory.

``python -m bench.soak`` runs ``--epochs`` epochs of ``--batches`` batches (over all workers) of
sample ids with a shuffled, exactly-once ``sharded_source``, checks every epoch, and prints the
resident memory of the trainer and each worker after the first and the last epoch. It also times
``close()`` of an 8-worker loader.
"""

from __future__ import annotations

import argparse
import functools
import time

import numpy as np
import psutil

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
        started = time.perf_counter()
        print(f"{'epoch':>5} {'batches':>8} {'lost':>5} {'dup':>5} {'padded':>6} {'seconds':>8}")
        for epoch in range(epochs):
            counts = np.zeros(total, dtype=np.int64)
            padded = 0
            seen = 0
            epoch_started = time.perf_counter()
            for batch in loader:
                ids = np.asarray(batch["id"]).ravel()
                real = len(ids) - batch.info.padded
                np.add.at(counts, ids[:real], 1)
                padded += batch.info.padded
                seen += 1
                del batch, ids
            lost = int((counts == 0).sum())
            duplicated = int((counts > 1).sum())
            ok &= lost == 0 and duplicated == 0
            print(
                f"{epoch:>5} {seen:>8} {lost:>5} {duplicated:>5} {padded:>6} "
                f"{time.perf_counter() - epoch_started:>8.2f}"
            )
            if epoch == 0:
                first = rss_mib([psutil.Process().pid, *pids])
        last = rss_mib([psutil.Process().pid, *pids])
        elapsed = time.perf_counter() - started
    print(f"\n{epochs * batches} batches in {elapsed:.1f} s")
    print(f"{'process':<10} {'RSS after epoch 0':>18} {'RSS after last':>15} {'change':>8}")
    names = ["trainer"] + [f"worker {i}" for i in range(workers)]
    for name, a, b in zip(names, first, last, strict=True):
        print(f"{name:<10} {a:>15.1f} MiB {b:>11.1f} MiB {b - a:>+7.1f}")
    return ok


def time_close(workers: int, repeats: int) -> list[float]:
    source = functools.partial(soak_source, total=workers * 8, batch_size=4)
    times = []
    for _ in range(repeats):
        loader = Loader(source, soak_step, batch_size=4, num_workers=workers, num_threads=1)
        next(iter(loader))
        started = time.perf_counter()
        loader.close()
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batches", type=int, default=3000, help="batches per epoch, all workers")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    ok = soak(args.epochs, args.batches, args.batch_size, args.workers)
    closes = time_close(8, 3)
    print(f"\nclose() of 8 workers: {', '.join(f'{t * 1000:.0f} ms' for t in closes)}")
    print("\nPASS: no sample lost or duplicated" if ok else "\nFAIL: samples lost or duplicated")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
