"""The command line: the main job. Runs in the trainer; the only module that prints."""

from __future__ import annotations

import argparse
import functools
import logging
import sys
from pathlib import Path

from tqdm import tqdm

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
        "processes, and report throughput.",
    )
    parser.add_argument(
        "--data",
        type=Path,
        default=None,
        help="an ImageFolder (root/<class>/<image>.jpg); default: a built-in sample dataset, "
        "generated into ~/.cache/dali-capture-loader on first use",
    )
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--batch-size", type=int, default=64, help="batch size (default 64)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs (default 3)")
    parser.add_argument(
        "--capture",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="trace the loop body once and replay it (default), or run it eagerly",
    )
    parser.add_argument("--threads", type=int, default=None, help="DALI threads per worker")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the loader does")
    return parser


def _table(stats: LoaderStats) -> str:
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
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    for name, value in (
        ("--workers", args.workers),
        ("--batch-size", args.batch_size),
        ("--epochs", args.epochs),
    ):
        if value < 1:
            print(f"error: {name} must be at least 1, got {value}", file=sys.stderr)
            return 2
    if args.data is None:
        if not sample_dataset_ready():
            print("generating the sample dataset (first run only)...", file=sys.stderr)
        root = ensure_sample_dataset()
    else:
        root = args.data
    try:
        files, _ = list_images(root)
    except (FileNotFoundError, NotADirectoryError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(
        f"{len(files)} images in {root}; {args.workers} workers, batch {args.batch_size}, "
        f"capture={'on' if args.capture else 'off'}"
    )
    source = functools.partial(image_source, root=str(root), batch_size=args.batch_size)
    try:
        with Loader(
            source,
            image_step,
            batch_size=args.batch_size,
            num_workers=args.workers,
            num_threads=args.threads,
            capture=args.capture,
            seed=args.seed,
        ) as loader:
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
            print(_table(loader.stats()))
    except (LoaderError, ValueError, TypeError, RuntimeError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0
