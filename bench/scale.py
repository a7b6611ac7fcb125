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
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from bench import _harness as H
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
    with H.Clock() as clock, _loader(total, WORLD_SIZE) as loader:
        batch = next(iter(loader))
        seconds = clock.lap()
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
        with H.Clock() as clock:
            loader.load_state_dict(every_rank(state))
            batch = next(iter(loader))
        row["resume_seconds"] = clock.wall
        del batch
        row["resume_peak"] = peak_rss(pid)
    return row


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--totals", type=int, nargs="+", default=[10_000, 1_000_000, 100_000_000])
    parser.add_argument("--repeats", type=int, default=3)


def parser() -> argparse.ArgumentParser:
    return H.parser("scale", __doc__, add_arguments, summary=False)


COLUMNS = [
    H.Col("samples", ","),
    H.Col("1st batch s", ".2f"),
    H.Col("vs first", "+.2f"),
    H.Col("worker MiB", ".0f"),
    H.Col("peak MiB", ".0f"),
    H.Col("trainer MiB", ".0f"),
    H.Col("state B", ",.0f"),
    H.Col("resume s", ".2f"),
    H.Col("peak MiB", ".0f"),
    H.Col("runs (s)", left=True),
]


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    first_batch(args.totals[0])  # warm: imports, page cache
    found = H.paired(
        {str(total): functools.partial(first_batch, total) for total in args.totals},
        rounds=args.repeats,
        order="fixed",
    )
    rows = []
    for total, timed in zip(args.totals, found.values(), strict=True):
        runs = [t.value for t in timed]
        rows.append(
            (total, {key: statistics.median(run[key] for run in runs) for key in runs[0]}, runs)
        )
    print(
        f"sharded_source, rank {RANK} of {WORLD_SIZE:,}, 1 worker, batches of {BATCH}; "
        f"median of {args.repeats}\n"
    )
    base_seconds, base_peak = rows[0][1]["seconds"], rows[0][1]["worker_peak"]
    H.print_table(
        COLUMNS,
        [
            (
                total,
                row["seconds"],
                row["seconds"] - base_seconds,
                row["worker_rss"] / MIB,
                row["worker_peak"] / MIB,
                row["trainer_rss"] / MIB,
                row["state_bytes"],
                row["resume_seconds"],
                row["resume_peak"] / MIB,
                H.runs(run["seconds"] for run in runs),
            )
            for total, row, runs in rows
        ],
    )
    last = rows[-1][1]
    print(
        f"\n{rows[-1][0]:,} vs {rows[0][0]:,}: first batch {last['seconds'] - base_seconds:+.2f} s "
        f"(target: within ~1 s), worker peak {(last['worker_peak'] - base_peak) / MIB:+.0f} MiB "
        "(target: at most ~100 MiB)"
    )


if __name__ == "__main__":
    main()
