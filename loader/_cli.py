"""The command line: the main job, and the dispatch to ``doctor`` (:mod:`loader._doctor`, a short
measurement of this job or yours and the loader's verdict on it). Runs in the trainer; with
``_doctor``, the only modules that print."""

from __future__ import annotations

import argparse
import functools
import logging
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ._diagnose import Diagnosis
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
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s (dali-capture-loader) {_version()}"
    )
    _job_flags(parser)
    parser.add_argument("--epochs", type=int, default=3, help="epochs (default 3)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    return parser


def _version() -> str:
    from . import __version__

    return __version__


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
        f"  startup            {stats.startup_seconds:.2f} s  (start workers, import DALI, "
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


def _check_flags(args: argparse.Namespace, counts: list[tuple[str, Any]]) -> bool:
    """Logging, and the flags' checks: False after printing why not."""
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    for name, value in counts:
        if value == "auto":
            continue
        if not value >= 1:
            print(f"error: {name} must be at least 1, got {value}", file=sys.stderr)
            return False
    return True


def _setup(
    args: argparse.Namespace, counts: list[tuple[str, Any]], *, quiet: bool = False
) -> Path | None:
    """Logging, the flags' checks and the dataset: its root, or None after printing why not.
    ``quiet``: say nothing unless something is wrong (a rank other than 0)."""
    if not _check_flags(args, counts):
        return None
    if args.data is None:
        if not sample_dataset_ready() and not quiet:
            print("generating the sample dataset (first run only)...", file=sys.stderr)
        root: Path = ensure_sample_dataset()
    else:
        root = args.data
    try:
        files, _ = list_images(root)
    except (FileNotFoundError, NotADirectoryError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return None
    if not quiet:
        print(f"{len(files)} images in {root}; {_layout(args)}")
    return root


def _layout(args: argparse.Namespace) -> str:
    return (
        f"{args.workers} workers, batch {args.batch_size}, "
        f"capture={'on' if args.capture else 'off'}"
    )


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
        from ._doctor import doctor  # (it builds on this module's flags)

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
