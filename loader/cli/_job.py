"""``python -m loader``: the main job (the image pipeline over a dataset, a progress bar per
epoch and a summary table). Part of the command line, so it prints."""

from __future__ import annotations

import argparse
import sys

from tqdm import tqdm

from .. import LoaderStats
from ..errors import LoaderError
from ..observe import Diagnosis
from ..sample import list_images
from ._flags import Terminated, data_format, job_flags, make_loader, setup, stopped


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
    job_flags(parser)
    parser.add_argument("--epochs", type=int, default=3, help="epochs (default 3)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    return parser


def _version() -> str:
    from .. import __version__

    return __version__


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


def run_job(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    counts = [("--workers", args.workers), ("--batch-size", args.batch_size)]
    root = setup(args, [*counts, ("--epochs", args.epochs)])
    if root is None:
        return 2
    try:
        with make_loader(args, root) as loader:
            if data_format(root) == "folder":
                total = len(list_images(root)[0])
            else:  # (each rank's share, padding included: the bar ends on the real count)
                total = len(loader) * args.batch_size
            for epoch in range(args.epochs):
                with tqdm(
                    total=total,
                    desc=f"epoch {epoch}",
                    unit="img",
                    disable=args.no_progress,
                    file=sys.stdout,
                ) as bar:
                    for batch in loader:
                        bar.update(len(batch["label"]) - batch.info.padded)
                        del batch
                    if bar.n < bar.total:  # (the last batch's padding: never delivered)
                        bar.total = bar.n
                        bar.refresh()
            print(_table(loader.stats(), loader.diagnose()))
    except (LoaderError, ValueError, TypeError, RuntimeError, OSError) as error:
        # (the library's advice names its keyword; here the flag says the same)
        said = str(error).replace("Pass columns=(...)", "Pass --columns IMAGE,LABEL")
        print(f"error: {said}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Terminated) as error:
        return stopped(error)
    return 0
