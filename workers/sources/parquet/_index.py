"""Indexing a Parquet dataset at once: what ``python -m loader index`` (and ``python -m loader.tars
index``) runs when the URLs name Parquet files. Runs in the index command's process.

:func:`index_parquet` lists the files (each directory once), keeps the entries of the summary
already beside them that still fit their files (identity unchanged; all are read again with
``force``), reads the other files' footers -- one ranged read of each file's tail, many at once
on threads (the work is waiting on the store or the disk) -- and writes each directory's summary
beside its files (:mod:`._summary`; in this node's cache where the store refuses it). A file
that is not Parquet, or whose footer is damaged, is named and left out of the summary (a job
then reads its footer itself, and fails naming it). Library code: progress goes to a callback.
"""

from __future__ import annotations

import contextlib
import fnmatch
import glob as globbing
import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..storage import RETRIES, Storage, expand_urls, is_glob, is_url, read_each, storage_for
from ._arrow import pyarrow_modules
from ._footers import footer_from_tail, parse_footer, tail_range
from ._plan import Listings, list_parquet
from ._summary import SUMMARY, FileEntry, entry_of, read_summary, summary_url, write_summary

__all__ = ["ParquetProgress", "index_parquet", "names_parquet"]

#: Footers read at once by default (threads: the work is waiting on the store).
THREADS = 32


@dataclass
class ParquetProgress:
    """Where an :func:`index_parquet` run stands (given to its ``progress`` callback)."""

    total: int
    up_to_date: int = 0
    done: int = 0
    read_bytes: int = 0
    rows: int = 0
    row_groups: int = 0
    failed: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    summaries: list[str] = field(default_factory=list)
    #: what reads the footers (``32 threads``)
    pool: str = ""

    @property
    def finished(self) -> int:
        return self.up_to_date + self.done


def names_parquet(
    urls: str | os.PathLike[str] | Sequence[str], storage_options: dict[str, Any] | None = None
) -> bool:
    """Whether ``urls`` name Parquet files (not tar shards): a name ending in ``.parquet``, a
    glob of them, or a directory holding ``*.parquet`` files and no ``*.tar`` (a remote one
    listed once)."""
    items = expand_urls(urls)
    if any(item.rstrip("/").endswith(".parquet") for item in items):
        return True
    if any(item.endswith(".tar") or "{" in item for item in items):
        return False
    for item in items:
        if is_glob(item.rsplit("/", 1)[-1]):  # (a pattern: what it matches)
            matched = _matches(item, storage_options)
            if any(name.endswith(".tar") for name in matched):
                return False
            if any(name.endswith(".parquet") for name in matched):
                return True
            continue
        if is_url(item) and not item.startswith("file://"):
            storage = storage_for(item, storage_options, RETRIES)
            names = list(storage.listing(item.rstrip("/")) or {})
        else:
            path = item[len("file://") :] if item.startswith("file://") else item
            names = os.listdir(path) if os.path.isdir(path) else []
        if any(n.endswith(".tar") for n in names):
            return False
        if any(n.endswith(".parquet") or n == SUMMARY for n in names):
            return True
    return False


def _matches(pattern: str, storage_options: dict[str, Any] | None) -> list[str]:
    """The names a glob's last part matches: of the local directory, or of the remote one's
    listing."""
    if is_url(pattern) and not pattern.startswith("file://"):
        storage = storage_for(pattern, storage_options, RETRIES)
        directory, _, last = pattern.rpartition("/")
        return fnmatch.filter(list(storage.listing(directory) or {}), last)
    return globbing.glob(pattern.removeprefix("file://"), recursive=True)


def index_parquet(
    urls: str | os.PathLike[str] | Sequence[str],
    storage_options: dict[str, Any] | None = None,
    *,
    threads: int | None = None,
    force: bool = False,
    retries: int = RETRIES,
    progress: Callable[[ParquetProgress], None] | None = None,
) -> ParquetProgress:
    """Read the footers of the Parquet files ``urls`` names and write their summary beside them
    (see the module docstring); ``threads`` footers at once (default :data:`THREADS`)."""
    pyarrow_modules()
    items = expand_urls(urls)
    if not items:
        raise ValueError("no Parquet files: the list of paths/URLs is empty")
    storage = storage_for(items[0], storage_options, retries)
    listings = Listings(storage)
    files = list_parquet(urls, storage, listings)
    identities = listings.identities(files)
    directories = sorted({storage.dirname(url) for url in files})
    old: dict[str, dict[str, FileEntry]] = {}
    for directory in directories:
        try:
            stored: bytes | None = storage.read_all(summary_url(storage, directory))
        except FileNotFoundError:
            stored = None
        found = read_summary(storage, directory, stored)
        old[directory] = {} if found is None else found[0]
    state = ParquetProgress(len(files))
    entries: dict[int, FileEntry] = {}
    todo = []
    for number, url in enumerate(files):
        entry = old[storage.dirname(url)].get(storage.basename(url))
        if entry is not None and entry.identity == identities[number] and not force:
            entries[number] = entry
            state.up_to_date += 1
        else:
            todo.append(number)
    workers = max(1, min(threads or THREADS, len(todo) or 1))
    state.pool = f"reading {len(todo)} footers, {workers} at once"
    if progress is not None:
        progress(state)

    try:
        _read_footers(storage, files, identities, todo, workers, entries, state, progress)
    finally:
        if entries:
            _save(storage, files, identities, entries, old, listings, state)
    state.rows = sum(entry.rows for entry in entries.values())
    state.row_groups = sum(len(entry.groups) for entry in entries.values())
    if progress is not None:
        progress(state)
    return state


def _read_footers(
    storage: Storage,
    files: list[str],
    identities: list[Any],
    todo: list[int],
    workers: int,
    entries: dict[int, FileEntry],
    state: ParquetProgress,
    progress: Callable[[ParquetProgress], None] | None,
) -> None:
    """Read the footers of files ``todo``, ``workers`` at once, into ``entries``: one ranged
    read of each tail (:func:`read_each`: on the filesystem's event loop where it has one),
    parsed here as they come."""
    reads, ready = [], []
    for number in todo:
        url, size = files[number], identities[number][0]
        try:
            reads.append((url, *tail_range(url, size)))
            ready.append(number)
        except ValueError as error:
            state.done += 1
            state.failed.append(f"{url}: ValueError: {error}")
    for k, tail in read_each(storage, reads, workers):
        number = ready[k]
        url, identity = files[number], identities[number]
        state.done += 1
        try:
            if isinstance(tail, Exception):
                raise tail
            data = footer_from_tail(storage, url, identity[0], tail)
            entries[number] = entry_of(identity, data, parse_footer(url, data))
            state.read_bytes += len(data)
        except (OSError, ValueError, EOFError) as error:
            state.failed.append(f"{url}: {type(error).__name__}: {error}")
        if progress is not None:  # (the printer says how often it prints)
            progress(state)


def _save(
    storage: Storage,
    files: list[str],
    identities: list[Any],
    entries: dict[int, FileEntry],
    old: dict[str, dict[str, FileEntry]],
    listings: Listings,
    state: ParquetProgress,
) -> None:
    """Write each directory's summary: the entries made or kept now, over the old summary's
    entries of other files still there as they were."""
    by_directory: dict[str, dict[str, FileEntry]] = {}
    for number, entry in entries.items():
        url = files[number]
        by_directory.setdefault(storage.dirname(url), {})[storage.basename(url)] = entry
    asked = {files[n] for n in range(len(files))}
    state.summaries = []
    for directory, new in sorted(by_directory.items()):
        listing = None if storage.local else listings(directory)
        kept = {}
        for name, entry in old.get(directory, {}).items():
            url = storage.join(directory, name)
            if url in asked:
                continue
            still: tuple[int, str] | None
            if storage.local:
                try:
                    still = storage.identity(url)
                except OSError:
                    continue
            else:
                still = None if listing is None else listing.get(name)
            if still == entry.identity:
                kept[name] = entry
        kept.update(new)
        _warn_partial(storage, directory, kept, listing)
        first = min(new)
        footer = parse_footer(storage.join(directory, first), new[first].footer)
        state.summaries.append(write_summary(storage, directory, kept, footer))


def _warn_partial(
    storage: Storage, directory: str, kept: dict[str, FileEntry], listing: Any
) -> None:
    """Warn where the summary of ``directory`` will name fewer Parquet files than it holds (a
    file or a glob indexed, not the directory): a job that reads the directory from a store
    takes the summary for its listing."""
    if storage.local:
        with contextlib.suppress(OSError):
            listing = dict.fromkeys(os.listdir(directory or "."))
    others = sorted(n for n in (listing or {}) if n.endswith(".parquet") and n not in kept)
    if others:
        warnings.warn(
            f"the summary of {directory} names {len(kept)} of its {len(kept) + len(others)} "
            f"Parquet files (not {', '.join(others[:3])}{', ...' if len(others) > 3 else ''}): "
            "a job that reads the directory from a store reads only the files its summary "
            "names. Index the directory itself to cover them all",
            stacklevel=2,
        )
