"""Epoch planning alone (no data, no DALI, no processes): ``python -m bench.plan [--quick]``.

What a worker computes before its first batch of an epoch, timed and measured (peak of Python and
numpy allocations, by ``tracemalloc``):

* plan: one shard's batches of a fresh epoch (``shard_batches`` with no position);
* reshard: a position with arbitrary received counts on one layout, then one shard's batches on a
  layout of half as many shards (what a worker of a resumed run on half the ranks computes).

Cases: 1B samples on 65,536 shards (targets: plan <= 0.1 s and <= 50 MB, reshard <= 0.5 s), 100M
on 8,192 and 10M on 1,024, batches of 256; next to today's ``workers.sources.plan._positions`` as of
:data:`BASELINE` (read with ``git show``: one permutation of the whole epoch) where it fits:
10M, and 100M without ``--quick``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tracemalloc
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench import _harness as H
from ipc.wire import Position, Sampling
from workers import shard_batches, steps_per_epoch

#: The last commit that planned epochs from one permutation of the whole dataset.
BASELINE = "db4938cf24f1a1007df49401ec0458df1dc315e2"

BATCH = 256
#: At 1B samples on 65,536 shards: (column, what, unit, at most).
TARGETS = [
    ("plan_seconds", "plan", "s", 0.1),
    ("plan_mb", "plan", "MB", 50.0),
    ("reshard_seconds", "reshard", "s", 0.5),
]

ShardBatches = Callable[[Sampling, int, int, int, Position | None], list[Any]]


def baseline() -> ShardBatches | None:
    """``shard_batches`` of :data:`BASELINE`, or None when git cannot show it."""
    root = Path(__file__).resolve().parents[1]
    shown = subprocess.run(
        ["git", "-C", str(root), "show", f"{BASELINE}:workers/_positions.py"],
        capture_output=True,
        text=True,
        check=False,
    )
    if shown.returncode:
        return None
    module = types.ModuleType("baseline_positions")
    name = f"{BASELINE[:7]}:workers/_positions.py"
    exec(compile(shown.stdout, name, "exec"), module.__dict__)
    function: ShardBatches = module.shard_batches
    return function


def peak_mb(call: Callable[[], object]) -> float:
    """The peak MB of one call under tracemalloc."""
    tracemalloc.start()
    try:
        call()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return peak / 2**20


def run_case(
    plan: ShardBatches, total: int, shards: int, repeats: int
) -> dict[str, float | int | str]:
    sampling = Sampling(total, BATCH, 0, True, False)
    steps = steps_per_epoch(total, shards, BATCH, False, shards)  # a shard per rank
    received = np.random.default_rng(1).integers(0, steps + 1, shards).tolist()
    position = Position(3, ((shards, tuple(received)),))
    new = shards // 2
    calls = {
        "plan": lambda: plan(sampling, 3, new + 1, shards, None),
        "reshard": lambda: plan(sampling, 3, new // 2, new, position),
    }
    found = H.paired(calls, rounds=repeats)  # best of ``repeats``, then one under tracemalloc
    return {
        "total": total,
        "shards": shards,
        "plan_seconds": min(t.wall for t in found["plan"]),
        "plan_mb": peak_mb(calls["plan"]),
        "reshard_seconds": min(t.wall for t in found["reshard"]),
        "reshard_mb": peak_mb(calls["reshard"]),
        "position_json_bytes": len(json.dumps(received)),
    }


COLUMNS = [
    H.Col("samples", ","),
    H.Col("shards"),
    H.Col("planning", left=True),
    H.Col("plan s", ".4f"),
    H.Col("plan MB", ".1f"),
    H.Col("reshard s", ".4f"),
    H.Col("reshard MB", ".1f"),
]


def render(rows: list[dict[str, Any]]) -> str:
    return H.table(
        COLUMNS,
        [
            (
                row["total"],
                f"{row['shards']:,} -> {row['shards'] // 2:,}",
                row["planning"],
                row["plan_seconds"],
                row["plan_mb"],
                row["reshard_seconds"],
                row["reshard_mb"],
            )
            for row in rows
        ],
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="the baseline at 10M only (< 20 s)")


def parser() -> argparse.ArgumentParser:
    return H.parser("plan", __doc__, add_arguments, summary=False)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    cases = [(10**9, 65_536), (10**8, 8_192), (10**7, 1_024)]
    rows = [
        {"planning": "per position", **run_case(shard_batches, total, shards, repeats=5)}
        for total, shards in cases
    ]
    old = baseline()
    if old is None:
        print(f"(today's planning not shown: git cannot show {BASELINE[:7]})")
    else:
        for total, shards in cases[2:] if args.quick else cases[1:]:
            row = run_case(old, total, shards, repeats=1)
            rows.append({"planning": f"whole ({BASELINE[:7]})", **row})
    print(f"one shard's plan, batches of {BATCH}; best of 5 (whole-epoch planning: 1 run)\n")
    print(render(rows))
    target = rows[0]
    print("\ntargets at 1B samples / 65,536 shards:")
    for column, what, unit, most in TARGETS:
        verdict = "met" if target[column] <= most else "MISSED"
        print(f"  {what}: {target[column]:.3g} {unit} (at most {most:g} {unit}): {verdict}")
    print(
        f"a position of 65,536 shards' received counts: {target['position_json_bytes']:,} bytes "
        "as JSON"
    )


if __name__ == "__main__":
    main()
