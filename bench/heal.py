"""Healing cost: ``python -m bench.heal``.

The images workload over ``sharded_files`` (batches of 8, W=2, ``max_restarts=1``): a worker
is killed with SIGKILL after the trainer received its first batches. Measured: the time from
the kill to the first batch of that worker's shard made by its replacement (spawn, DALI import,
sources rebuilt at the first batch not received, trace), next to a fresh loader's time to its
first batch."""

from __future__ import annotations

import functools
import os
import signal
import statistics
import time

from bench import _sources as S
from loader import Loader, ensure_sample_dataset
from loader.sample import image_step

BATCH = 8  # small batches: an epoch long enough to kill a worker in its middle


def _loader(root: str) -> Loader:
    source = functools.partial(S.files_source, root=root, batch_size=BATCH)
    return Loader(source, image_step, batch_size=BATCH, num_workers=2, max_restarts=1)


def time_to_heal(root: str) -> float:
    with _loader(root) as loader:
        batches = iter(loader)
        prefetched = 0
        for batch in batches:
            if batch.info.worker == 0:
                prefetched = batch.info.step
                break
        del batch
        time.sleep(1.0)  # worker 0 fills its slots: all it made before dying is delivered first
        os.kill(loader.worker_pids()[0], signal.SIGKILL)
        killed = time.perf_counter()
        made_before = prefetched + loader.config.num_slots  # steps it can have published
        for batch in batches:
            if batch.info.worker == 0 and batch.info.step > made_before:
                break
            del batch
        elapsed = time.perf_counter() - killed
        assert loader.stats().restarts == 1
    return elapsed


def time_fresh(root: str) -> float:
    started = time.perf_counter()
    with _loader(root) as loader:
        batch = next(iter(loader))
        elapsed = time.perf_counter() - started
        del batch
    return elapsed


def main() -> None:
    root = str(ensure_sample_dataset())
    heal = [time_to_heal(root) for _ in range(3)]
    fresh = [time_fresh(root) for _ in range(3)]
    print(f"{'images, sharded_files, W=2':<40} {'median s':>9} {'runs':>20}")
    for label, runs in (
        ("kill -> next batch of its shard", heal),
        ("fresh loader -> 1st batch", fresh),
    ):
        shown = " ".join(f"{r:.2f}" for r in runs)
        print(f"{label:<40} {statistics.median(runs):>9.2f} {shown:>20}")
    print("target: kill -> next batch of its shard <= 3 s")


if __name__ == "__main__":
    main()
