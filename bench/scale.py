"""A worker's cost against the dataset's size, through the public API: ``python -m bench.scale``.

One Loader per size over ``sharded_source(total)`` of sample ids, as rank 5 of 8,192 with one
worker (batches of 256): the seconds from the Loader's construction to its first batch, and the
worker's resident memory then (``psutil``) and at its peak (``VmHWM``), for 10k, 1M and 100M
samples side by side in one run (``--totals`` for others). Also the trainer's resident memory
after its first batch, the size of its ``state_dict`` as JSON, and a resume on another layout: a
state of all 8,192 ranks (arbitrary received counts) loaded by rank 5 of 4,096, timed from
``load_state_dict`` to the first batch, with that worker's peak. Each size runs ``--repeats``
times (median shown); the loaders run one after another, never side by side.

Target (issue 23): at 100M the first batch comes within ~1 s of 10k's, and the worker does not
grow by more than ~100 MiB.
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
import psutil

from bench import _sources as S
from loader import Loader, steps_per_epoch

RANK, WORLD_SIZE, BATCH = 5, 8_192, 256
MIB = 2**20


def peak_rss(pid: int) -> int:
    """The highest resident memory of process ``pid`` so far (bytes; Linux ``VmHWM``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return int(psutil.Process(pid).memory_info().rss)


def _loader(total: int, world_size: int) -> Loader:
    source = functools.partial(S.soak_source, total=total, batch_size=BATCH)
    return Loader(
        source, S.soak_step, batch_size=BATCH, num_workers=1, rank=RANK, world_size=world_size
    )


def every_rank(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (one rank's, taken without a process group) as if every rank had received an
    arbitrary number of its batches."""
    steps = steps_per_epoch(state["sampling"]["total"], WORLD_SIZE, BATCH, False, WORLD_SIZE)
    received = np.random.default_rng(1).integers(0, steps + 1, WORLD_SIZE).tolist()
    return {**state, "received": received, "steps": received}


def first_batch(total: int) -> dict[str, float]:
    """One loader over ``total`` samples: first batch seconds and memory (bytes), then a resume
    of every rank's state on half the ranks."""
    started = time.perf_counter()
    with _loader(total, WORLD_SIZE) as loader:
        batch = next(iter(loader))
        seconds = time.perf_counter() - started
        del batch
        (pid,) = loader.worker_pids()
        state = loader.state_dict()
        row = {
            "seconds": seconds,
            "worker_rss": psutil.Process(pid).memory_info().rss,
            "worker_peak": peak_rss(pid),
            "trainer_rss": psutil.Process().memory_info().rss,
            "state_bytes": len(json.dumps(state)),
        }
    with _loader(total, WORLD_SIZE // 2) as loader:
        (pid,) = loader.worker_pids()
        started = time.perf_counter()
        loader.load_state_dict(every_rank(state))
        batch = next(iter(loader))
        row["resume_seconds"] = time.perf_counter() - started
        del batch
        row["resume_peak"] = peak_rss(pid)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__)
    parser.add_argument("--totals", type=int, nargs="+", default=[10_000, 1_000_000, 100_000_000])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    first_batch(args.totals[0])  # warm: imports, page cache
    rows = []
    for total in args.totals:
        runs = [first_batch(total) for _ in range(args.repeats)]
        rows.append(
            (total, {key: statistics.median(run[key] for run in runs) for key in runs[0]}, runs)
        )
    print(
        f"sharded_source, rank {RANK} of {WORLD_SIZE:,}, 1 worker, batches of {BATCH}; "
        f"median of {args.repeats}\n"
    )
    print(
        f"{'samples':>13} {'1st batch s':>12} {'vs first':>9} {'worker MiB':>11} "
        f"{'peak MiB':>9} {'trainer MiB':>12} {'state B':>8} {'resume s':>9} "
        f"{'peak MiB':>9}  runs (s)"
    )
    base_seconds, base_peak = rows[0][1]["seconds"], rows[0][1]["worker_peak"]
    for total, row, runs in rows:
        shown = " ".join(f"{run['seconds']:.2f}" for run in runs)
        print(
            f"{total:>13,} {row['seconds']:>12.2f} {row['seconds'] - base_seconds:>+9.2f} "
            f"{row['worker_rss'] / MIB:>11.0f} {row['worker_peak'] / MIB:>9.0f} "
            f"{row['trainer_rss'] / MIB:>12.0f} {row['state_bytes']:>8,.0f} "
            f"{row['resume_seconds']:>9.2f} {row['resume_peak'] / MIB:>9.0f}  {shown}"
        )
    last = rows[-1][1]
    print(
        f"\n{rows[-1][0]:,} vs {rows[0][0]:,}: first batch {last['seconds'] - base_seconds:+.2f} s "
        f"(target: within ~1 s), worker peak {(last['worker_peak'] - base_peak) / MIB:+.0f} MiB "
        "(target: at most ~100 MiB)"
    )


if __name__ == "__main__":
    main()
