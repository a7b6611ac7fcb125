"""Healing cost: ``python -m bench.heal [--empty-files N]``.

The images workload over ``sharded_files`` (batches of 8, W=2, ``max_restarts=1``): a worker
is killed with SIGKILL after the trainer received its first batches. Measured: the time from
the kill to the first batch of that worker's shard made by its replacement (spawn, DALI import,
sources rebuilt at the first batch not received, trace), next to a fresh loader's time to its
first batch.

``--empty-files N``: the same over an ImageFolder of ``N`` empty files (1,000 classes) written
under the temporary directory and deleted after, with a step that passes the labels on (nothing
to decode): what the size of a folder costs a worker, at ImageNet's 1,281,167 for instance. The
first fresh loader runs first, in a cache directory of its own (``DALI_LOADER_CACHE_DIR``), so
it is the job's first: the one that lists the folder.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shutil
import signal
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench import _harness as H
from bench import _sources as S
from loader import Loader, ensure_sample_dataset
from loader.sample import image_step

BATCH = 8  # small batches: an epoch long enough to kill a worker in its middle
CLASSES = 1_000


def _loader(root: str, step: Callable[..., Any]) -> Loader:
    source = functools.partial(S.files_source, root=root, batch_size=BATCH)
    return Loader(source, step, batch_size=BATCH, num_workers=2, max_restarts=1)


@contextlib.contextmanager
def empty_folder(count: int) -> Iterator[str]:
    """An ImageFolder of ``count`` empty ``.jpg`` files in ``CLASSES`` folders, deleted after."""
    root = Path(tempfile.mkdtemp(prefix="bench-heal-"))
    try:
        for label in range(CLASSES):
            folder = root / f"class_{label:04d}"
            folder.mkdir()
            for index in range(label, count, CLASSES):
                (folder / f"img_{index:08d}.jpg").touch()
        long_ago = time.time() - 60  # a folder that was there before the job, as data is
        for folder in [root, *root.iterdir()]:
            os.utime(folder, (long_ago, long_ago))
        yield str(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def time_to_heal(root: str, step: Callable[..., Any]) -> float:
    with _loader(root, step) as loader:
        batches = iter(loader)
        prefetched = 0
        for batch in batches:
            if batch.info.worker == 0:
                prefetched = batch.info.worker_step
                break
        del batch
        time.sleep(1.0)  # worker 0 fills its slots: all it made before dying is delivered first
        os.kill(loader.worker_pids()[0], signal.SIGKILL)
        made_before = prefetched + loader.config.num_slots  # steps it can have published
        with H.Clock() as clock:
            for batch in batches:
                if batch.info.worker == 0 and batch.info.worker_step > made_before:
                    break
                del batch
        assert loader.stats().restarts == 1
    return clock.wall


def time_fresh(root: str, step: Callable[..., Any]) -> float:
    with H.Clock() as clock, _loader(root, step) as loader:
        batch = next(iter(loader))
        elapsed = clock.lap()
        del batch
    return elapsed


def measure(root: str, step: Callable[..., Any], title: str) -> None:
    first = time_fresh(root, step)  # the first loader of the job
    found = H.paired(
        {
            "kill -> next batch of its shard": lambda: time_to_heal(root, step),
            "later fresh loader -> 1st batch": lambda: time_fresh(root, step),
        },
        rounds=3,
        order="fixed",
    )
    heal, fresh = ([t.value for t in runs] for runs in found.values())
    H.print_table(
        [H.Col(title, left=True), H.Col("median s", ".2f"), H.Col("runs")],
        [
            (label, statistics.median(runs), H.runs(runs))
            for label, runs in (
                ("kill -> next batch of its shard", heal),
                ("first loader of the job -> 1st batch", [first]),
                ("later fresh loader -> 1st batch", fresh),
            )
        ],
    )
    print("target: kill -> next batch of its shard <= 3 s")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--empty-files", type=int, metavar="N", help="a folder of N empty files")


def parser() -> argparse.ArgumentParser:
    return H.parser("heal", __doc__, add_arguments, summary=False)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.empty_files is None:
        measure(str(ensure_sample_dataset()), image_step, "images, sharded_files, W=2")
        return
    with tempfile.TemporaryDirectory(prefix="bench-heal-cache-") as cache:
        os.environ["DALI_LOADER_CACHE_DIR"] = cache  # (inherited by the workers)
        with H.Clock() as clock, empty_folder(args.empty_files) as root:
            written = clock.lap()
            print(f"{args.empty_files:,} empty files written in {written:.0f} s")
            title = f"{args.empty_files:,} empty files, W=2"
            measure(root, S.labels_step, title)


if __name__ == "__main__":
    main()
