"""``python -m loader doctor``: measure a job for a few seconds and print the loader's verdict on
it. Runs in the trainer (every rank of it under ``torchrun``); part of the command line, so it
prints.

The job is the built-in image pipeline over ``--data DIR`` (the main job's), or your own:
``--source MOD:FUNC --step MOD:FUNC [--feeders MOD:FUNC]`` name module-level functions the way
the workers import them (``importlib.import_module(MOD)``, then the attribute ``FUNC``); a
function with a ``batch_size`` parameter gets ``--batch-size``. Under a launcher (``WORLD_SIZE``
above 1, as ``torchrun`` sets it) every rank runs the job; the doctor joins the ranks in a
``gloo`` process group (unless one is up), stops every rank at the same step (one ``all_reduce``
per step, as a DDP step would), and rank 0 prints the verdict: its own, every rank's verdict
line, and the settings every rank shares (see docs/diagnosis.md).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from .. import Loader
from ..config import distributed
from ..errors import LoaderError
from ..observe import Diagnosis, measure_headspace, rank_path
from ._flags import Terminated, check_flags, job_flags, layout, make_loader, setup, stopped


def build_doctor_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loader doctor",
        description="Run a job for a few seconds, then print the loader's verdict "
        "(loader.diagnose()) and, given --train-ms, the headspace: how fast the loop goes over "
        "batches replayed from memory, without the loader. The job: the main job's pipeline over "
        "--data, or your own --source and --step. Under torchrun every rank runs it and rank 0 "
        "prints.",
    )
    job_flags(parser)
    parser.add_argument(
        "--source",
        metavar="MOD:FUNC",
        default=None,
        help="your source(shard), a module-level function (e.g. mypackage.data:train_source); "
        "given a batch_size parameter, it gets --batch-size",
    )
    parser.add_argument(
        "--step", metavar="MOD:FUNC", default=None, help="your step(*outputs, **feeders)"
    )
    parser.add_argument(
        "--feeders", metavar="MOD:FUNC", default=None, help="your feeders(shard), if any"
    )
    parser.add_argument(
        "--seconds", type=float, default=10.0, help="seconds to measure after the first batch"
    )
    parser.add_argument(
        "--train-ms",
        type=float,
        default=0.0,
        metavar="MS",
        help="milliseconds your training step takes: a stand-in step that long runs per batch, "
        "and the headspace is timed with it (default 0: no step, no headspace)",
    )
    parser.add_argument(
        "--headspace",
        type=int,
        default=4,
        metavar="N",
        help="batches kept in memory and replayed to time the loop alone, with --train-ms "
        "(default 4; 0: skip)",
    )
    parser.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="also write the trace here (one file per rank: {rank} in the name, else "
        ".rank<k> before the extension)",
    )
    return parser


def import_function(spec: str, flag: str) -> Callable[..., Any]:
    """The function ``MOD:FUNC`` names, imported as a worker imports it; ``ValueError`` saying
    what to change when it cannot be."""
    module_name, colon, name = spec.partition(":")
    if not colon or not module_name or not name:
        raise ValueError(
            f"{flag} takes MODULE:FUNCTION, a module-level function the workers can import "
            f"(e.g. {flag} mypackage.data:train_source), got {spec!r}"
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is None or not module_name.startswith(error.name):
            raise ValueError(f"{flag} {spec}: importing {module_name} failed: {error}") from None
        raise ValueError(
            f"{flag} {spec}: there is no module {module_name!r} to import ({error}); run from "
            "the folder that holds it, or add that folder to PYTHONPATH"
        ) from None
    except Exception as error:  # the user's module failed while it was imported
        raise ValueError(
            f"{flag} {spec}: importing {module_name} failed: {type(error).__name__}: {error}"
        ) from error
    found: Any = module
    for part in name.split("."):
        if not hasattr(found, part):
            functions = sorted(
                key
                for key, value in vars(module).items()
                if inspect.isfunction(value)
                and value.__module__ == module.__name__
                and not key.startswith("_")
            )
            listed = f"; its functions: {', '.join(functions[:12])}" if functions else ""
            raise ValueError(f"{flag} {spec}: module {module_name} has no {name!r}{listed}")
        found = getattr(found, part)
    if not callable(found):
        raise ValueError(
            f"{flag} {spec}: {name} is a {type(found).__name__}, not a function to call"
        )
    return found  # type: ignore[no-any-return]


def with_batch_size(function: Callable[..., Any], batch_size: int) -> Callable[..., Any]:
    """``function`` with ``batch_size=`` bound when it takes one (a source, feeders)."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return function
    if "batch_size" not in parameters:
        return function
    return functools.partial(function, batch_size=batch_size)


def user_functions(args: argparse.Namespace) -> dict[str, Any]:
    """``--source``, ``--step`` and ``--feeders`` imported (``batch_size`` bound where taken):
    the Loader's arguments; ``ValueError`` when one cannot be imported."""
    source = import_function(args.source, "--source")
    step = import_function(args.step, "--step")
    feeders = None if args.feeders is None else import_function(args.feeders, "--feeders")
    return {
        "source": with_batch_size(source, args.batch_size),
        "step": step,
        "feeders": None if feeders is None else with_batch_size(feeders, args.batch_size),
    }


def _user_loader(args: argparse.Namespace, functions: dict[str, Any]) -> Loader:
    return Loader(
        functions["source"],
        functions["step"],
        feeders=functions["feeders"],
        batch_size=args.batch_size,
        num_workers=args.workers,
        num_threads=args.threads,
        capture=args.capture,
        seed=args.seed,
        trace=args.trace,
    )


@contextmanager
def _ranks() -> Iterator[tuple[int, int]]:
    """This process's rank and the world size; under a launcher (``WORLD_SIZE`` above 1) in a
    process group, made here (gloo) unless one is up, and taken down after."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        yield 0, 1
        return
    try:
        import torch.distributed as dist
    except ImportError:
        raise ValueError(
            f"WORLD_SIZE={world}: under a launcher the doctor gathers every rank's figures "
            "with torch.distributed; install torch (pip install torch), or run it alone"
        ) from None
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo")
    try:
        yield int(dist.get_rank()), int(dist.get_world_size())
    finally:
        if made and dist.is_initialized():
            dist.destroy_process_group()


def _any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is on any (a collective with a process group up)."""
    if distributed.group_size() <= 1:
        return flag
    import torch
    import torch.distributed as dist

    value = torch.tensor([int(flag)])
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def _stand_in_step(train_seconds: float) -> Callable[[Any], None]:
    """The doctor's training step: reads the batch's first output, then sleeps
    ``train_seconds``."""

    def train_step(batch: Any) -> None:
        first = next(iter(batch.values())) if isinstance(batch, Mapping) else batch
        if isinstance(first, (tuple, list)):
            first = first[0]
        int(np.asarray(first).shape[0])
        if train_seconds > 0:
            time.sleep(train_seconds)

    return train_step


def _kept(batch: Any) -> Any:
    """A copy of ``batch`` in memory, for the headspace (the slot goes back)."""
    if isinstance(batch, Mapping):
        return {name: np.array(value) for name, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        return tuple(np.array(value) for value in batch)
    return np.array(batch)


def _headspace_batches(args: argparse.Namespace) -> int:
    """The batches to keep for the headspace: ``--headspace``, but none without a training step
    (``--train-ms``): timed alone, a loop body that does nothing runs at a meaningless rate."""
    return args.headspace if args.train_ms > 0 else 0


NO_HEADSPACE = (
    "  headspace: not computed, the loop body has no training step to time; give one with "
    "--train-ms MS (the milliseconds your training step takes)"
)


def _measure(
    loader: Loader, args: argparse.Namespace, train_step: Callable[[Any], None], kept: list[Any]
) -> int:
    """Iterate for ``--seconds`` after the traced first batch (every rank stops at the same
    step), keeping the first ``--headspace`` batches when there is a headspace to time
    (``--train-ms``); the batches taken."""
    keep = _headspace_batches(args)
    batches, until = 0, None
    while True:
        taken = batches
        for batch in loader:
            if len(kept) < keep:
                kept.append(_kept(batch))
            train_step(batch)
            del batch
            batches += 1
            if until is None:  # the traced first batch is not measured
                until = time.perf_counter() + args.seconds
            if _any_rank(time.perf_counter() >= until):
                return batches
        if batches == taken:  # an epoch without batches: nothing more to measure
            return batches


def doctor(argv: list[str]) -> int:
    """``python -m loader doctor [flags]``: measure, then print the verdict and the headspace."""
    args = build_doctor_parser().parse_args(argv)
    own = [args.source, args.step, args.feeders]
    if any(own) and not (args.source and args.step):
        print("error: --source and --step go together (--feeders is optional)", file=sys.stderr)
        return 2
    if args.source and args.data is not None:
        print("error: either --data (the built-in pipeline) or --source/--step", file=sys.stderr)
        return 2
    if args.headspace < 0 or args.train_ms < 0:
        print("error: --headspace and --train-ms must be at least 0", file=sys.stderr)
        return 2
    rank = 0
    try:
        with _ranks() as (rank, world):
            return _doctor(args, rank, world)
    except (LoaderError, ValueError, TypeError, RuntimeError, OSError) as error:
        where = f"rank {rank}: " if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 else ""
        print(f"error: {where}{error}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Terminated) as error:
        return stopped(error)


def _doctor(args: argparse.Namespace, rank: int, world: int) -> int:
    counts = [("--workers", args.workers), ("--batch-size", args.batch_size)]
    counts.append(("--seconds", args.seconds * 10))  # (0.1 s at least)
    if args.source:
        if not check_flags(args, counts):
            return 2
        try:
            functions = user_functions(args)
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        if rank == 0:
            print(f"source {args.source}, step {args.step}; {layout(args)}")
        make = functools.partial(_user_loader, args, functions)
    else:
        root = setup(args, counts, quiet=rank != 0)
        if root is None:
            return 2
        make = functools.partial(make_loader, args, root, args.trace)
    train_step = _stand_in_step(args.train_ms / 1000)
    kept: list[Any] = []
    with make() as loader:
        batches = _measure(loader, args, train_step, kept)
        report = loader.diagnose(window=args.seconds)
        stats = loader.stats(window=args.seconds)
    recent = stats.recent_trainer
    rate = recent.batches / recent.loop if recent.loop > 0 else 0.0
    alone = measure_headspace(kept, train_step, max(1, recent.batches)) if kept else None
    mine = {
        "rate": rate,
        "batches": batches,
        "alone": alone,
        "reads": (stats.row_groups_read, stats.read_requests, stats.bytes_read),
    }
    gathered = distributed.gather(mine) or [mine]
    if rank == 0:
        no_step = args.headspace > 0 and not _headspace_batches(args)
        _print_report(report, gathered, len(kept), args.trace, world, no_step=no_step)
    return 0


def _print_report(
    report: Diagnosis,
    ranks: list[dict[str, Any]],
    kept: int,
    trace: Path | None,
    world: int,
    *,
    no_step: bool = False,
) -> None:
    """The report, each rank's rate and headspace (or, ``no_step``, the line saying why there is
    none and how to give a training step), and the trace files."""
    print()
    print(report)
    for index, figures in enumerate(ranks):
        who = f"rank {index}: " if len(ranks) > 1 else ""
        rate = figures["rate"]
        print(f"  {who}with the loader: {rate:.1f} batches/s ({figures['batches']} batches)")
        units, requests, nbytes = figures.get("reads", (0, 0, 0))
        if requests:
            print(
                f"  {who}read: {units} row groups in {requests} requests, "
                f"{nbytes / 1e6:,.1f} MB (stats().row_groups_read, read_requests, bytes_read)"
            )
        alone = figures["alone"]
        if alone is not None:
            print(
                f"  {who}headspace: the loop alone, over {kept} batches replayed from memory: "
                f"{alone:.1f} batches/s"
                + (f"; with the loader it runs at {rate / alone:.2%} of that" if alone > 0 else "")
            )
    if no_step:
        print(NO_HEADSPACE)
    if trace is not None:
        paths = [str(rank_path(trace, r, world)) for r in range(world)]
        print(f"  trace: {', '.join(paths)} (open it in https://ui.perfetto.dev)")
