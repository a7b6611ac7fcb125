"""The command line: the main job. Runs in the trainer; the only module that prints."""

from __future__ import annotations

import argparse
import functools
import logging
import sys
import time
from pathlib import Path

from tqdm import tqdm

from ._errors import LoaderError
from ._loader import Loader, LoaderStats
from ._sample import (
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


def _table(stats: LoaderStats, samples: int, seconds: float, batch_size: int) -> str:
    moved_mb = stats.bytes_moved / 1e6
    lines = [
        "",
        "summary",
        f"  samples            {samples}",
        f"  wall time          {seconds:.2f} s",
        f"  samples/s          {samples / seconds:.1f}",
        f"  MB/s moved         {moved_mb / seconds:.1f}  ({moved_mb:.1f} MB in all)",
        f"  first batch after  {stats.time_to_first_batch or 0.0:.2f} s",
        f"  trainer waited     {stats.wait_seconds:.2f} s",
        "",
        f"  {'worker':>6} {'shard':>5} {'steps':>6} {'traces':>6} {'trace ms':>9} "
        f"{'batches/s':>10} {'blocked s':>9}",
    ]
    for w in stats.workers:
        trace_ms = 1000 * w.trace_seconds[0] if w.trace_seconds else 0.0
        lines.append(
            f"  {w.worker:>6} {w.shard:>5} {w.steps:>6} {w.traces:>6} {trace_ms:>9.1f} "
            f"{w.batches_per_second:>10.1f} {w.blocked_seconds:>9.2f}"
        )
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
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(
        f"{len(files)} images in {root}; {args.workers} workers, batch {args.batch_size}, "
        f"capture={'on' if args.capture else 'off'}"
    )
    source = functools.partial(image_source, root=str(root), batch_size=args.batch_size)
    samples = 0
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
            started = time.perf_counter()
            for epoch in range(args.epochs):
                with tqdm(
                    total=len(files),
                    desc=f"epoch {epoch}",
                    unit="img",
                    disable=args.no_progress,
                    file=sys.stdout,
                ) as bar:
                    for batch in loader:
                        count = len(batch["label"]) - batch.info.padded
                        samples += count
                        bar.update(count)
                        del batch
            seconds = time.perf_counter() - started
            print(_table(loader.stats(), samples, seconds, args.batch_size))
    except (LoaderError, ValueError, TypeError, RuntimeError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0
