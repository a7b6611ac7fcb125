"""``python -m loader.tars``: write WebDataset tar shards, and index a dataset of them once.

``python -m loader.tars write --from DIR --to OUT --samples-per-shard N`` writes an ImageFolder as
``OUT/train-000000.tar`` and on (each sample ``<key>.jpg`` and ``<key>.cls``, in a seeded random
order), each shard's index beside it (``train-000000.idx``, DALI's ``wds2idx`` format) and the
shards' summary (``OUT/loader-summary.json``). ``python -m loader.tars --from ...`` (no command)
is the same.

``python -m loader.tars index URLS... [--storage-options JSON] [--threads N] [--workers N]
[--force]`` indexes every shard of a dataset (local paths or fsspec URLs, brace patterns
allowed), remote shards N threads at a time (default 32), local ones with N processes: a shard
whose ``.idx`` exists and fits it is read, any other is scanned once and its ``.idx`` written
beside it (a small one, of at most 1 KB, kept in the summary instead, unless ``--idx-files``);
then the summary is written beside the shards (a job writes neither there unless
asked: ``publish_index=True``). Run it again to finish an
interrupted run: what is done is not done again. After it, a worker's start costs a few requests
whatever the number of shards, on every node.

The same command indexes a Parquet dataset (the URLs name ``*.parquet`` files, a glob of them, or
a directory holding them): it reads every file's footer (``--threads`` at once, local files
too) and writes the files' summary, ``loader-parquet-summary.json``, beside them, so that a
job's start reads no footer and no listing. ``python -m loader index`` is the same command.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from ipc.limits import usable_cpus
from workers import (
    IndexProgress,
    ParquetProgress,
    StorageLibraryError,
    check_storage_libraries,
    index_dataset,
    index_parquet,
    names_parquet,
    write_tars,
)


class _Failures(Protocol):
    failed: Any  # the shards or files that could not be indexed


_State = TypeVar("_State", bound=_Failures)

_COMMANDS = ("write", "index")


def main(argv: Sequence[str] | None = None, prog: str = "python -m loader.tars") -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in (*_COMMANDS, "-h", "--help"):
        args.insert(0, "write")  # (the form without a command writes, as it always did)
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Write WebDataset tar shards, or index a dataset of them once.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    write = commands.add_parser(
        "write",
        help="write an ImageFolder as shards, with their indexes and summary",
        description="Write an ImageFolder (root/<class>/<image>) as WebDataset tar shards, "
        "each with its .idx, and the shards' summary.",
    )
    write.add_argument("--from", dest="source", required=True, help="the ImageFolder's root")
    write.add_argument("--to", dest="target", required=True, help="where to write the shards")
    write.add_argument(
        "--samples-per-shard",
        type=int,
        required=True,
        help="samples in each shard (the last may hold fewer)",
    )
    write.add_argument("--prefix", default="train", help="shard names: PREFIX-000000.tar ...")
    write.add_argument("--seed", type=int, default=0, help="seed of the samples' order")
    write.add_argument(
        "--no-shuffle",
        action="store_true",
        help="keep the folder's order (classes one after another) instead of a seeded random one",
    )
    _index_arguments(
        commands.add_parser(
            "index",
            help="index a dataset once (tar shards or Parquet files): its summary beside it",
            description="Index every shard (DALI's wds2idx .idx beside each) and write the "
            "shards' summary beside them, or read every Parquet file's footer and write the "
            "files' summary beside them, so that workers start with a few requests on any node.",
        )
    )
    parsed = parser.parse_args(args)
    if parsed.command == "index":
        return _index(parsed)
    return _write(parsed)


def _index_arguments(index: argparse.ArgumentParser) -> None:
    index.add_argument(
        "urls",
        nargs="+",
        help="shard paths or URLs; brace patterns like 's3://b/train-{000000..001023}.tar'; "
        "or Parquet files: paths, a directory, a glob, URLs",
    )
    index.add_argument(
        "--storage-options",
        default=None,
        help='JSON for the filesystem (s3fs: {"endpoint_url": "...", "key": "..."})',
    )
    index.add_argument(
        "--workers",
        type=int,
        default=None,
        help="local shards: processes indexing at once (default: the CPUs this process may use)",
    )
    index.add_argument(
        "--threads",
        type=int,
        default=None,
        help="remote shards, and Parquet files: indexed at once, by threads (default 32)",
    )
    index.add_argument(
        "--force", action="store_true", help="scan every shard again, whatever exists"
    )
    index.add_argument(
        "--idx-files",
        action="store_true",
        help="write every shard's .idx beside it (for DALI's readers.webdataset); by default "
        "a small shard's index (at most 1 KB of .idx) is kept in the summary instead",
    )


def _write(args: argparse.Namespace) -> int:
    started = time.monotonic()
    try:
        written = write_tars(
            args.source,
            args.target,
            samples_per_shard=args.samples_per_shard,
            shuffle=not args.no_shuffle,
            seed=args.seed,
            prefix=args.prefix,
        )
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    size = sum(path.stat().st_size for path in written)
    last = written[-1].name
    print(
        f"wrote {len(written)} shards ({size / 1e6:.1f} MB) in {time.monotonic() - started:.1f} s: "
        f"{written[0].parent}/{args.prefix}-{{{'0' * 6}..{last[len(args.prefix) + 1 : -4]}}}.tar, "
        "each with its .idx, and loader-summary.json"
    )
    return 0


class _Shown:
    """Prints an index run's progress: a head line (what there is, what is up to date), then one
    line every few seconds (rewritten on a terminal). ``unit``: what is indexed (shards, files);
    ``details(state, elapsed)``: what the format's line says of the work done."""

    def __init__(self, unit: str, details: Callable[[Any, float], str]) -> None:
        self.unit, self.details = unit, details
        self.tty = sys.stdout.isatty()
        self.last = 0.0
        self.ended = self.headed = False

    def __call__(self, state: Any) -> None:
        now = time.monotonic()
        if not self.headed:  # (the first call: what is to be indexed is listed)
            self.headed = True
            print(
                f"{state.total} {self.unit}, {state.up_to_date} up to date; {state.pool}",
                flush=True,
            )
        final = state.finished == state.total
        if self.ended or (not final and now - self.last < (0.5 if self.tty else 5.0)):
            return
        self.ended = final
        self.last = now
        elapsed = now - state.started
        left = state.total - state.finished
        eta = elapsed / state.done * left if state.done else 0.0
        line = (
            f"[{state.finished:>{len(str(state.total))}}/{state.total}] "
            f"{100 * state.finished / max(1, state.total):5.1f}%  "
            + self.details(state, elapsed)
            + (f", {len(state.failed)} failed" if state.failed else "")
            + (f"  eta {eta:,.0f} s" if left and state.done else "")
        )
        print(("\r" + line + ("\n" if final else "")) if self.tty else line, end="", flush=True)
        if not self.tty:
            print(flush=True)


def _tar_details(state: IndexProgress, elapsed: float) -> str:
    rate = state.scanned_bytes / elapsed / 1e6 if elapsed > 0 else 0.0
    return (
        f"scanned {state.scanned} ({state.scanned_bytes / 1e6:,.0f} MB, {rate:,.0f} MB/s), "
        f"read {state.read_idx} .idx, "
        + (f"{state.from_cache} from this node's cache, " if state.from_cache else "")
        + f"{state.up_to_date} up to date"
    )


def _parquet_details(state: ParquetProgress, elapsed: float) -> str:
    return (
        f"read {state.done} footers ({state.read_bytes / 1e6:,.1f} MB), "
        f"{state.up_to_date} up to date"
    )


def _storage_options(args: argparse.Namespace) -> dict[str, Any] | str | None:
    """``--storage-options`` parsed, or the error to print."""
    if not args.storage_options:
        return None
    try:
        options = json.loads(args.storage_options)
    except json.JSONDecodeError as error:
        return f"error: --storage-options is not JSON: {error}"
    if not isinstance(options, dict):
        return "error: --storage-options must be a JSON object"
    return options


def _index(args: argparse.Namespace) -> int:
    options = _storage_options(args)
    if isinstance(options, str):
        print(options, file=sys.stderr)
        return 2
    for name in ("workers", "threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            print(f"error: --{name} must be >= 1", file=sys.stderr)
            return 2
    try:  # (said once, before any process starts)
        check_storage_libraries(args.urls)
    except StorageLibraryError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    urls = args.urls[0] if len(args.urls) == 1 else args.urls
    try:
        parquet = names_parquet(urls, options)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if parquet:
        return _index_parquet(args, urls, options)
    processes = args.workers or usable_cpus()
    print(f"indexing {' '.join(args.urls)}", flush=True)
    state = _ran(
        lambda: index_dataset(
            urls,
            options,
            processes=processes,
            threads=args.threads,
            force=args.force,
            progress=_Shown("shards", _tar_details),
            idx_files=args.idx_files,
        )
    )
    if isinstance(state, int):
        return state
    print(
        f"{state.total - len(state.failed)} of {state.total} shards indexed "
        f"({state.samples:,} samples) in {time.monotonic() - state.started:.1f} s; "
        f"summary: {', '.join(state.summaries) or ('up to date' if state.up_to_date else 'none')}"
    )
    if state.inlined:
        print(
            f"{state.inlined} small shards' indexes are kept in the summary, not beside them "
            "(--idx-files writes their .idx files, which DALI's readers.webdataset reads)"
        )
    if state.not_beside:
        print(
            f"error: {state.not_beside} index(es) could not be written beside their shards "
            "(see the log): each node would index them again; index with write access",
            file=sys.stderr,
        )
    if state.failed:
        print(
            f"error: {len(state.failed)} shard(s) could not be indexed: rewrite or drop them, "
            "then run this again",
            file=sys.stderr,
        )
    return 1 if state.failed or state.not_beside else 0


def _index_parquet(
    args: argparse.Namespace, urls: str | list[str], options: dict[str, Any] | None
) -> int:
    print(f"indexing the Parquet files of {' '.join(args.urls)}", flush=True)
    started = time.monotonic()
    state = _ran(
        lambda: index_parquet(
            urls,
            options,
            threads=args.threads,
            force=args.force,
            progress=_Shown("files", _parquet_details),
        )
    )
    if isinstance(state, int):
        return state
    print(
        f"{state.total - len(state.failed)} of {state.total} files indexed "
        f"({state.rows:,} rows in {state.row_groups:,} row groups) in "
        f"{time.monotonic() - started:.1f} s; summary: {', '.join(state.summaries) or 'none'}"
    )
    if state.failed:
        print(
            f"error: {len(state.failed)} file(s) could not be indexed: rewrite or drop them, "
            "then run this again",
            file=sys.stderr,
        )
    return 1 if state.failed else 0


def _ran(index: Callable[[], _State]) -> _State | int:
    """``index()`` (the failures it lists said on stderr), or the exit status of an
    interruption (130) or of what it refused (2, the reason said)."""
    try:
        state = index()
    except KeyboardInterrupt:
        print("\ninterrupted: run the same command again to finish", file=sys.stderr)
        return 130
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for failure in state.failed:
        print(f"failed: {failure}", file=sys.stderr)
    return state
