"""``num_workers="auto"`` against the best fixed layout: ``python -m bench.autotune``
(``--quick`` for a short run).

For each workload of ``python -m bench`` (images, python, tiny; see ``bench/run.py``), an auto
loader first runs its tuning epochs (until it settles, at most ``--tune-epochs``, plus one to
start the layout it settled on). Then it and a loader of every fixed layout (W in 1, 2, 4 workers
times the DALI threads: the CPUs split among the workers, and 1 where that differs) run
``--epochs`` epochs side by side: one epoch of each in turn, in a rotated order, each after one
warm-up epoch of its own. The throughput of each is its median epoch (batches per second from
the epoch's ``iter()`` to its end); ``auto / best`` is the auto loader's over the best fixed
layout's, and ``auto / same`` over the fixed loader of the very layout auto chose (how far two
loaders of one layout differ on this machine: the noise the other ratio sits in). Every loader
uses the forkserver (a new layout of the auto loader starts its workers
as fast as the fixed loaders started theirs). The auto loader's memory (its workers' USS plus
slots, measured after each epoch) is checked against its budget. The machine's load average is
printed before and after: on a busy machine the ratios move by more than the 5% they are judged
by.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psutil

from bench import _harness as H
from bench import _sources as S
from loader import Loader, ensure_sample_dataset
from loader.sample import image_source, image_step


@dataclass
class Workload:
    name: str
    batch_size: int
    source: Callable[..., Any]
    step: Callable[..., Any]


@dataclass
class Contender:
    name: str
    loader: Loader
    rates: list[float] = field(default_factory=list)
    memory: int = 0  # the largest measured, workers' USS plus slots


def workloads(quick: bool) -> list[Workload]:
    root = str(ensure_sample_dataset())
    return [
        Workload(
            "images",
            32,
            functools.partial(image_source, root=root, batch_size=32, shuffle=True),
            image_step,
        ),
        Workload(
            "python",
            S.PY_BATCH,
            functools.partial(S.python_source, batches=128 if quick else 256),
            S.light_step,
        ),
        Workload(
            "tiny",
            S.TINY_BATCH,
            functools.partial(S.tiny_source, batches=2000 if quick else 6000),
            S.tiny_step,
        ),
    ]


def epoch_rate(loader: Loader) -> float:
    """One epoch; batches per second from its ``iter()`` to its end."""
    batches = 0
    with H.Clock() as clock:
        for batch in loader:
            batches += 1
            del batch
    return batches / clock.wall


def fixed_layouts(cpus: int, quick: bool) -> list[tuple[int, int]]:
    layouts = []
    for workers in (1, 2, 4):
        split = max(1, cpus // workers)
        for threads in sorted({split} if quick else {split, 1}):
            layouts.append((workers, threads))
    return layouts


def workers_memory(loader: Loader) -> int:
    """What the loader's workers hold: each one's USS plus its slots (as the loader counts)."""
    total = 0
    for worker, pid in zip(loader.stats().workers, loader.worker_pids(), strict=False):
        uss = int(psutil.Process(pid).memory_full_info().uss)
        slots = loader.config.num_slots * (worker.bytes // worker.steps) if worker.steps else 0
        total += uss + slots
    return total


def _timed_epoch(contender: Contender, auto: bool) -> None:
    contender.rates.append(epoch_rate(contender.loader))
    if auto:
        contender.memory = max(contender.memory, workers_memory(contender.loader))


def run_workload(workload: Workload, args: argparse.Namespace) -> dict[str, Any]:
    common: dict[str, Any] = {"batch_size": workload.batch_size, "start_method": "forkserver"}
    auto = Contender(
        "auto",
        Loader(
            workload.source,
            workload.step,
            num_workers="auto",
            memory_limit=args.memory_limit,
            **common,
        ),
    )
    contenders = [auto]
    cpus = auto.loader.stats().cpus
    try:
        tuning = 0
        while tuning < args.tune_epochs:
            epoch_rate(auto.loader)
            tuning += 1
            report = auto.loader.stats().autotune
            assert report is not None
            if report.settled:
                break
        epoch_rate(auto.loader)  # the settled layout's first epoch (a new pool, maybe)
        for workers, threads in fixed_layouts(cpus, args.quick):
            loader = Loader(
                workload.source, workload.step, num_workers=workers, num_threads=threads, **common
            )
            contenders.append(Contender(f"W={workers} x {threads} threads", loader))
            epoch_rate(loader)  # warm-up: the traced first batches
        H.paired(
            {c.name: functools.partial(_timed_epoch, c, c is auto) for c in contenders},
            rounds=args.epochs,
            order="rotate",
        )
        report = auto.loader.stats().autotune
        assert report is not None
    finally:
        for contender in contenders:
            contender.loader.close()
    medians = {c.name: statistics.median(c.rates) for c in contenders}
    fixed = {name: rate for name, rate in medians.items() if name != "auto"}
    best = max(fixed, key=lambda name: fixed[name])
    same = f"W={report.layout.workers} x {report.layout.threads} threads"
    peak = max([auto.memory, *(t.memory for t in report.trials)])
    return {
        "workload": workload.name,
        "cpus": cpus,
        "tuning_epochs": tuning,
        "layout": f"W={report.layout.workers} x {report.layout.threads} threads",
        "settled": report.settled,
        "reason": report.reason,
        "medians": medians,
        "best": best,
        "ratio": medians["auto"] / fixed[best] if fixed[best] else 0.0,
        # the fixed loader of auto's own layout: how far two loaders of one layout differ here
        "same": medians["auto"] / fixed[same] if fixed.get(same) else None,
        "memory": peak,
        "memory_limit": report.memory_limit,
    }


COLUMNS = [
    H.Col("workload", left=True),
    H.Col("auto chose", left=True),
    H.Col("tuning"),
    H.Col("auto b/s", ".1f"),
    H.Col("best fixed", left=True),
    H.Col("b/s", ".1f"),
    H.Col("auto/best", ".2f", "x"),
    H.Col("auto/same", ".2f", "x"),
    H.Col("memory / budget"),
]


def render(rows: list[dict[str, Any]]) -> str:
    cells = [
        (
            row["workload"],
            row["layout"],
            row["tuning_epochs"],
            row["medians"]["auto"],
            row["best"],
            row["medians"][row["best"]],
            row["ratio"],
            row["same"],
            f"{row['memory'] / 2**20:.0f} / {row['memory_limit'] / 2**20:.0f} MiB",
        )
        for row in rows
    ]
    lines = [H.table(COLUMNS, cells), ""]
    lines.append("auto/same: against the fixed loader of the layout auto chose (the noise here)")
    lines.append("every fixed layout (median batches/s):")
    for row in rows:
        others = ", ".join(
            f"{name}: {rate:.1f}" for name, rate in row["medians"].items() if name != "auto"
        )
        lines.append(f"  {row['workload']:<8} {others}")
    return "\n".join(lines)


def _limit(text: str) -> int | float:
    return float(text) if "." in text else int(text)


def parser() -> argparse.ArgumentParser:
    return H.parser("autotune", __doc__, add_arguments, summary=False)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="shorter epochs, one thread split")
    parser.add_argument("--epochs", type=int, default=None, help="timed epochs per contender")
    parser.add_argument("--tune-epochs", type=int, default=5, help="most tuning epochs")
    parser.add_argument(
        "--memory-limit",
        type=_limit,
        default=None,
        help="the auto loader's memory_limit: bytes (an integer) or a fraction (0, 1]",
    )
    parser.add_argument(
        "--workloads", default="images,python,tiny", help="comma-separated: images,python,tiny"
    )


def main(argv: list[str] | None = None) -> None:
    built = parser()
    args = built.parse_args(argv)
    if args.epochs is None:
        args.epochs = 5 if args.quick else 9
    wanted = args.workloads.split(",")
    unknown = set(wanted) - {"images", "python", "tiny"}
    if unknown:
        built.error(f"unknown workloads: {', '.join(sorted(unknown))}")
    load_before = os.getloadavg()
    print(f"load average {load_before[0]:.1f}", flush=True)
    rows = []
    clock = H.Clock().__enter__()
    for workload in workloads(args.quick):
        if workload.name in wanted:
            rows.append(run_workload(workload, args))
            print(f"  {workload.name} ({rows[-1]['cpus']} CPUs): {rows[-1]['reason']}", flush=True)
    print()
    print(render(rows))
    load_after = os.getloadavg()
    print(
        f"\n{clock.lap():.0f} s; load average {load_before[0]:.1f} before, "
        f"{load_after[0]:.1f} after (1-minute)"
    )


if __name__ == "__main__":
    main()
