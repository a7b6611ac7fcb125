"""The Parquet files a dataset's ``urls`` name. Runs in the worker (and in the index command).

Each item is a file, a directory (its ``*.parquet`` files in name order; a remote one with a
summary: the files the summary names, no listing), or a glob (its matches sorted; ``**`` goes
into subdirectories, locally as on a store). A name that exists as it is written wins over the
glob its characters would make (a file named ``a?.parquet``, ``[v2].parquet``, a directory
``d*z``), and a glob that matches only directories gives their ``*.parquet`` files.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from ..storage import Identity, Storage, expand_urls, is_glob, is_url, local_glob
from ._summary import FileEntry

__all__ = ["list_parquet"]

Listing = Callable[[str], "dict[str, Identity] | None"]
SummaryOf = Callable[[str], "tuple[dict[str, FileEntry], str] | None"]


def list_parquet(
    urls: str | os.PathLike[str] | Sequence[str],
    storage: Storage,
    listings: Listing | None = None,
    summaries: SummaryOf | None = None,
) -> list[str]:
    """The files ``urls`` names, in order (see the module docstring)."""
    found: list[str] = []
    listing = listings if listings is not None else storage.listing
    for item in expand_urls(urls):
        if is_url(item) and not item.startswith("file://"):
            found.extend(_remote(item, storage, listing, summaries))
        else:
            found.extend(_local(item.removeprefix("file://")))
    if not found:
        raise ValueError("no Parquet files: the list of paths/URLs is empty")
    return found


def _local(path: str) -> list[str]:
    if os.path.isdir(path):
        return _directory(path)
    matches = local_glob(path)
    if matches is None:
        return [path]
    files = [match for match in matches if os.path.isfile(match)]
    if files:
        return files
    directories = [match for match in matches if os.path.isdir(match)]
    if not directories:
        raise FileNotFoundError(f"no file matches {path}")
    return [file for directory in directories for file in _directory(directory)]


def _directory(path: str) -> list[str]:
    names = sorted(n for n in os.listdir(path) if n.endswith(".parquet"))
    if not names:
        raise FileNotFoundError(f"{path} holds no *.parquet file")
    return [os.path.join(path, name) for name in names]


def _remote(
    item: str, storage: Storage, listing: Listing, summaries: SummaryOf | None
) -> list[str]:
    pattern = is_glob(item)
    if pattern:
        matches = storage.glob(item)
        if matches:
            return matches
        # (no object matches: the characters may be the name's own, a file's or a directory's)
    summary = None
    if summaries is not None and not item.endswith(".parquet"):
        summary = summaries(item.rstrip("/"))
    if summary is not None and summary[0]:
        names = sorted(n for n in summary[0] if n.endswith(".parquet"))
        return [storage.join(item.rstrip("/"), name) for name in names]
    listed = listing(item)
    names = sorted(n for n in (listed or {}) if n.endswith(".parquet"))
    if names:
        return [storage.join(item, name) for name in names]
    if pattern:
        try:
            storage.identity(item)
        except FileNotFoundError:
            raise FileNotFoundError(f"no file matches {item}") from None
    return [item]
