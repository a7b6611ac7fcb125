"""The job's flags, shared by the main job (:mod:`loader.cli._job`) and ``doctor``
(:mod:`loader.cli._doctor`): what the job is (its data, workers, batch size, capture, threads,
seed), their checks, the dataset they name and the loader they build. Prints only errors."""

from __future__ import annotations

import argparse
import functools
import glob as globbing
import logging
import sys
from pathlib import Path
from typing import Any

from .. import Loader, ParquetDataset, TarsDataset
from ..sample import (
    default_cache_dir,
    ensure_sample_dataset,
    image_source,
    image_step,
    list_images,
    sample_dataset_ready,
)


class Terminated(BaseException):
    """A SIGTERM reached the command (raised by its handler, caught as Ctrl-C is)."""


def stopped(error: BaseException) -> int:
    """Say how the command was stopped (Ctrl-C or a SIGTERM); its exit status, as the shell's."""
    if isinstance(error, Terminated):
        print("terminated (SIGTERM)", file=sys.stderr)
        return 143
    print("interrupted", file=sys.stderr)
    return 130


def job_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of the job itself, the same for the main job and ``doctor``."""
    parser.add_argument(
        "--data",
        type=_data,
        default=None,
        help="an ImageFolder (root/<class>/<image>.jpg), Parquet (a .parquet file, a directory "
        "of them, a glob or a URL: its image and label columns) or WebDataset tars (a .tar "
        "path, pattern or URL: their .jpg and .cls members); default: a built-in sample "
        "dataset, generated into ~/.cache/dali-capture-loader on first use",
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
    parser.add_argument(
        "--columns",
        type=_columns,
        default=None,
        metavar="IMAGE,LABEL",
        help="the image and label columns of Parquet data (default image,label), or the "
        "image and label members of tars (default jpg,cls)",
    )
    parser.add_argument("--threads", type=int, default=None, help="DALI threads per worker")
    parser.add_argument(
        "--seed", type=int, default=0, help="the seed of the epochs' orders and draws (>= 0)"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the loader does")


def _columns(text: str) -> tuple[str, str]:
    """``--columns``: two names, the image's and the label's."""
    names = tuple(name.strip() for name in text.split(","))
    if len(names) != 2 or not all(names):
        raise argparse.ArgumentTypeError(
            f"expected two names, the image's and the label's (image,label), got {text!r}"
        )
    return names[0], names[1]


def _data(text: str) -> Path | str:
    """``--data``: an ImageFolder's path, or the text naming Parquet files or tar shards."""
    return text if data_format(text) != "folder" else Path(text)


def data_format(data: Path | str) -> str:
    """``"parquet"``, ``"tars"`` or ``"folder"``: what ``--data`` names, from its name (a URL,
    a ``.parquet`` or ``.tar`` name or pattern) or, for a local directory, what it holds."""
    text = str(data)
    base = text.rstrip("/").rsplit("/", 1)[-1]
    if ".tar" in base:
        return "tars"
    if ".parquet" in base or "://" in text:
        return "parquet"
    if any(c in base for c in "*?["):  # (a pattern without the extension: what it matches)
        matches = globbing.glob(text, recursive=True)
        if any(match.endswith(".parquet") for match in matches):
            return "parquet"
        if any(match.endswith(".tar") for match in matches):
            return "tars"
    path = Path(text)
    if path.is_dir() and any(path.glob("*.parquet")):
        return "parquet"
    if path.is_dir() and any(path.glob("*.tar")):
        return "tars"
    return "folder"


def nested_parquet(root: Path | str) -> str:
    """Where a directory that is no ImageFolder holds Parquet files one or two levels down (as
    ``load_dataset``'s and the Hub's layouts do: ``data/train-*.parquet``): a hint naming
    them, else ``""``."""
    path = Path(root)
    if not path.is_dir():
        return ""
    for pattern in ("*/*.parquet", "*/*/*.parquet"):
        found = sorted(path.glob(pattern))
        if found:
            return (
                f"; it holds Parquet files under {found[0].parent}: pass --data "
                f"'{found[0].parent}' (or a glob such as '{path}/{pattern}')"
            )
    return ""


def _workers(text: str) -> int | str:
    """``--workers``: a count, or ``auto``."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or auto, got {text!r}") from None


def check_flags(args: argparse.Namespace, counts: list[tuple[str, Any]]) -> bool:
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


def setup(
    args: argparse.Namespace, counts: list[tuple[str, Any]], *, quiet: bool = False
) -> Path | str | None:
    """Logging, the flags' checks and the dataset: its root, or None after printing why not.
    ``quiet``: say nothing unless something is wrong (a rank other than 0)."""
    if not check_flags(args, counts):
        return None
    if args.data is None:
        if not sample_dataset_ready() and not quiet:
            print("generating the sample dataset (first run only)...", file=sys.stderr)
        try:
            root: Path = ensure_sample_dataset()
        except OSError as error:
            print(
                f"error: the sample dataset cannot be written to {default_cache_dir()} "
                f"({type(error).__name__}: {error.strerror or error}): set XDG_CACHE_HOME to a "
                "writable directory, or pass --data",
                file=sys.stderr,
            )
            return None
    else:
        root = args.data
    if data_format(root) == "folder" and args.columns is not None:
        print(
            "error: --columns names Parquet columns or tar members, not an ImageFolder's",
            file=sys.stderr,
        )
        return None
    text = str(root)
    local = "://" not in text and not any(c in text for c in "*?[{")
    if data_format(root) != "folder" and local and not Path(text).exists():
        print(f"error: {text} does not exist", file=sys.stderr)
        return None
    if data_format(root) != "folder":
        if not quiet:
            print(f"{data_format(root)} data at {root}; {layout(args)}")
        return str(root)
    try:
        files, _ = list_images(root)
    except (FileNotFoundError, NotADirectoryError, ValueError) as error:
        print(f"error: {error}{nested_parquet(root)}", file=sys.stderr)
        return None
    if not quiet:
        print(f"{len(files)} images in {root}; {layout(args)}")
    return root


def layout(args: argparse.Namespace) -> str:
    return (
        f"{args.workers} workers, batch {args.batch_size}, "
        f"capture={'on' if args.capture else 'off'}"
    )


def make_loader(args: argparse.Namespace, root: Path | str, trace: Path | None = None) -> Loader:
    """The job's loader: the image pipeline over ``root`` (an ImageFolder, Parquet or tars)."""
    source: Any
    kind = data_format(root)
    if kind == "parquet":
        source = ParquetDataset(str(root), columns=args.columns or ("image", "label"))
    elif kind == "tars":
        source = TarsDataset(str(root), ext=args.columns or ("jpg", "cls"))
    else:
        source = functools.partial(image_source, root=str(root))  # (batch_size: the Loader's)
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
