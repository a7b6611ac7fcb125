"""The command line: the main job, and ``doctor`` (a short measurement of the same job and the
loader's verdict on it). Runs in the trainer; the only module that prints."""

from __future__ import annotations

import argparse
import functools
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from ._diagnose import Diagnosis, measure_headspace
from ._errors import LoaderError
from ._loader import Loader, LoaderStats
from .sample import (
    ensure_sample_dataset,
    image_source,
    image_step,
    list_images,
    sample_dataset_ready,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loader",
        description="Decode, crop, flip and normalize JPEGs with DALI capture mode in worker "
        "processes, and report throughput. 'python -m loader doctor [flags]' measures the same "
        "job for a few seconds and says whether the input pipeline holds the loop back.",
    )
    _job_flags(parser)
    parser.add_argument("--epochs", type=int, default=3, help="epochs (default 3)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    return parser


def build_doctor_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loader doctor",
        description="Run the main job's pipeline for a few seconds, then print the loader's "
        "verdict (loader.diagnose()) and the headspace: how fast the loop goes over batches "
        "replayed from memory, without the loader.",
    )
    _job_flags(parser)
    parser.add_argument(
        "--seconds", type=float, default=10.0, help="seconds to measure after the first batch"
    )
    parser.add_argument(
        "--train-ms",
        type=float,
        default=0.0,
        help="milliseconds of a stand-in training step per batch (default 0: none)",
    )
    parser.add_argument(
        "--headspace",
        type=int,
        default=4,
        metavar="N",
        help="batches kept in memory and replayed to time the loop alone (default 4; 0: skip)",
    )
    parser.add_argument("--trace", type=Path, default=None, help="also write the trace here")
    return parser


def _job_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of the job itself, the same for the main job and ``doctor``."""
    parser.add_argument(
        "--data",
        type=Path,
        default=None,
        help="an ImageFolder (root/<class>/<image>.jpg); default: a built-in sample dataset, "
        "generated into ~/.cache/dali-capture-loader on first use",
    )
    parser.add_argument(
        "--workers",
        type=_workers,
        default=2,
        help="worker processes (default 2), or auto: tuned between epochs (num_workers='auto')",
    )
    parser.add_argument("--batch-size", type=int, default=64, help="batch size (default 64)")
    parser.add_argument(
        "--capture",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="trace the loop body once and replay it (default), or run it eagerly",
    )
    parser.add_argument("--threads", type=int, default=None, help="DALI threads per worker")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the loader does")


def _table(stats: LoaderStats, report: Diagnosis | None = None) -> str:
    """The summary: startup and iteration apart, so that every figure adds up."""
    moved_mb = stats.bytes_moved / 1e6
    seconds = stats.iteration_seconds
    first = stats.time_to_first_batch or 0.0
    lines = [
        "",
        "summary",
        f"  startup            {stats.startup_seconds:.2f} s  (spawn workers, import DALI, "
        "open sources)",
        f"  iteration          {seconds:.2f} s  (first iter() to last batch, all epochs)",
        f"    first batch      {first:.2f} s  (the traced first step)",
        f"    trainer waited   {stats.wait_seconds:.2f} s",
        f"  samples            {stats.samples}  (padded rows not counted)",
        f"  samples/s          {stats.samples_per_second:.1f}",
        f"  batches/s          {stats.batches_per_second:.1f}",
        f"  MB/s moved         {moved_mb / seconds if seconds > 0 else 0.0:.1f}  "
        f"({moved_mb:.1f} MB in all)",
        "",
        f"  {'worker':>6} {'shard':>5} {'steps':>6} {'traces':>6} {'1st step ms':>11} "
        f"{'batches/s':>10} {'blocked s':>9}",
    ]
    for w in stats.workers:
        first_step_ms = 1000 * w.trace_seconds[0] if w.trace_seconds else 0.0
        lines.append(
            f"  {w.worker:>6} {w.shard:>5} {w.steps:>6} {w.traces:>6} {first_step_ms:>11.1f} "
            f"{w.batches_per_second:>10.1f} {w.blocked_seconds:>9.2f}"
        )
    lines.append(
        "  traces: loops traced for capture; 1st step ms: the first step, traced or eager;"
    )
    lines.append("  batches/s: per second of the worker's busy time")
    if stats.autotune is not None:
        tuned = stats.autotune
        lines.append("")
        lines.append(
            f"  autotune           {tuned.layout}{'' if tuned.settled else ' (still searching)'}: "
            f"{tuned.reason}"
        )
    if report is not None:
        lines.append("")
        lines.append(f"  diagnosis          {report.verdict}")
        lines.append("                     (python -m loader doctor ... for what to change)")
    return "\n".join(lines)


def _workers(text: str) -> int | str:
    """``--workers``: a count, or ``auto``."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or auto, got {text!r}") from None


def _setup(args: argparse.Namespace, counts: list[tuple[str, Any]]) -> Path | None:
    """Logging, the flags' checks and the dataset: its root, or None after printing why not."""
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    for name, value in counts:
        if value == "auto":
            continue
        if not value >= 1:
            print(f"error: {name} must be at least 1, got {value}", file=sys.stderr)
            return None
    if args.data is None:
        if not sample_dataset_ready():
            print("generating the sample dataset (first run only)...", file=sys.stderr)
        root: Path = ensure_sample_dataset()
    else:
        root = args.data
    try:
        files, _ = list_images(root)
    except (FileNotFoundError, NotADirectoryError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return None
    print(
        f"{len(files)} images in {root}; {args.workers} workers, batch {args.batch_size}, "
        f"capture={'on' if args.capture else 'off'}"
    )
    return root


def _loader(args: argparse.Namespace, root: Path, trace: Path | None = None) -> Loader:
    source = functools.partial(image_source, root=str(root), batch_size=args.batch_size)
    return Loader(
        source,
        image_step,
        batch_size=args.batch_size,
        num_workers=args.workers,
        num_threads=args.threads,
        capture=args.capture,
        seed=args.seed,
        trace=trace,
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["doctor"]:
        return doctor(argv[1:])
    args = build_parser().parse_args(argv)
    counts = [("--workers", args.workers), ("--batch-size", args.batch_size)]
    root = _setup(args, [*counts, ("--epochs", args.epochs)])
    if root is None:
        return 2
    files, _ = list_images(root)
    try:
        with _loader(args, root) as loader:
            for epoch in range(args.epochs):
                with tqdm(
                    total=len(files),
                    desc=f"epoch {epoch}",
                    unit="img",
                    disable=args.no_progress,
                    file=sys.stdout,
                ) as bar:
                    for batch in loader:
                        bar.update(len(batch["label"]) - batch.info.padded)
                        del batch
            print(_table(loader.stats(), loader.diagnose()))
    except (LoaderError, ValueError, TypeError, RuntimeError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


def _stand_in_step(train_seconds: float) -> Callable[[Any], None]:
    """The doctor's training step: reads the batch's labels, then sleeps ``train_seconds``."""

    def train_step(batch: Any) -> None:
        int(np.asarray(batch["label"]).shape[0])
        if train_seconds > 0:
            time.sleep(train_seconds)

    return train_step


def doctor(argv: list[str]) -> int:
    """``python -m loader doctor [flags]``: measure, then print the verdict and the headspace."""
    args = build_doctor_parser().parse_args(argv)
    counts = [("--workers", args.workers), ("--batch-size", args.batch_size)]
    root = _setup(args, [*counts, ("--seconds", args.seconds * 10)])  # (0.1 s at least)
    if root is None:
        return 2
    if args.headspace < 0 or args.train_ms < 0:
        print("error: --headspace and --train-ms must be at least 0", file=sys.stderr)
        return 2
    train_step = _stand_in_step(args.train_ms / 1000)
    kept: list[dict[str, np.ndarray[Any, Any]]] = []
    try:
        with _loader(args, root, args.trace) as loader:
            batches, until = 0, None
            while until is None or time.perf_counter() < until:
                for batch in loader:
                    if len(kept) < args.headspace:
                        kept.append({name: np.array(value) for name, value in batch.items()})
                    train_step(batch)
                    del batch
                    batches += 1
                    if until is None:  # the traced first batch is not measured
                        until = time.perf_counter() + args.seconds
                    elif time.perf_counter() >= until:
                        break
            report = loader.diagnose(window=args.seconds)
            stats = loader.stats(window=args.seconds)
    except (LoaderError, ValueError, TypeError, RuntimeError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    print()
    print(report)
    recent = stats.recent_trainer
    rate = recent.batches / recent.loop if recent.loop > 0 else 0.0
    print(f"  with the loader: {rate:.1f} batches/s ({batches} batches)")
    if kept:
        alone = measure_headspace(kept, train_step, max(1, recent.batches))
        print(
            f"  headspace: the loop alone, over {len(kept)} batches replayed from memory: "
            f"{alone:.1f} batches/s"
            + (f"; with the loader it runs at {rate / alone:.2%} of that" if alone > 0 else "")
        )
    if args.trace is not None:
        print(f"  trace: {args.trace} (open it in https://ui.perfetto.dev)")
    return 0
