"""The paths and URLs a dataset's ``urls`` give, WebDataset brace patterns expanded."""

from __future__ import annotations

import glob as globbing
import os
from collections.abc import Iterable

from ._storage import is_url

__all__ = ["expand_urls", "is_glob", "local_glob"]


def is_glob(path: str) -> bool:
    """Whether ``path`` holds a glob's characters (``*``, ``?``, ``[``)."""
    return any(c in path for c in "*?[")


def local_glob(path: str) -> list[str] | None:
    """The local paths the glob ``path`` matches, sorted (``**`` goes into subdirectories);
    None where ``path`` is no glob, or a name that exists as it is written (``a?.parquet``)."""
    if not is_glob(path) or os.path.exists(path):
        return None
    return sorted(globbing.glob(path, recursive=True))


def expand_urls(urls: str | os.PathLike[str] | Iterable[str]) -> list[str]:
    """A list of paths/URLs, or one with WebDataset brace patterns expanded:
    ``train-{000000..000127}.tar`` (zero-padded ranges) and ``{a,b}`` (alternatives)."""
    items = [urls] if isinstance(urls, (str, os.PathLike)) else list(urls)
    expanded: list[str] = []
    for item in items:
        if not isinstance(item, (str, os.PathLike)):
            raise TypeError(f"a shard's path or URL must be a str, got {type(item).__name__}")
        text = os.fspath(item)
        # (a local name that exists as written is not a pattern: a directory named d{1,2})
        literal = not is_url(text) and "{" in text and os.path.exists(text)
        expanded.extend([text] if literal else _braces(text))
    if not expanded:
        raise ValueError("no shards: the list of tar paths/URLs is empty")
    return expanded


def _braces(pattern: str) -> list[str]:
    start = pattern.find("{")
    if start < 0:
        if "}" in pattern:
            raise ValueError(f"unbalanced braces in the shard pattern {pattern!r}")
        return [pattern]
    end = pattern.find("}", start)
    if end < 0:
        raise ValueError(f"unbalanced braces in the shard pattern {pattern!r}")
    inside, rest = pattern[start + 1 : end], _braces(pattern[end + 1 :])
    head = pattern[:start]
    if ".." in inside:
        low, _, high = inside.partition("..")
        if not (low.isdigit() and high.isdigit()) or int(low) > int(high):
            raise ValueError(
                f"the range {{{inside}}} in {pattern!r} must be {{first..last}} of integers, "
                "first <= last"
            )
        width = len(low) if low.startswith("0") else 0
        options = [str(number).zfill(width) for number in range(int(low), int(high) + 1)]
    else:
        options = inside.split(",")
    return [head + option + tail for option in options for tail in rest]
