"""The node's cache directory: where the indexes a worker makes are kept for every later start
(an ImageFolder's listing, a tar shard's index, a listing or summary shared by the workers
started together). Runs in the worker.

``$DALI_LOADER_CACHE_DIR``, else ``$XDG_CACHE_HOME/dali-capture-loader``, else
``~/.cache/dali-capture-loader``; never next to the data, which may be read-only. Each kind of
index has its folder in it (``file-index/``, ``tar-index/``). One cache directory per node by
default; one per job when ``DALI_LOADER_CACHE_DIR`` names a directory every node shares.
"""

from __future__ import annotations

import os
from pathlib import Path

#: Names the directory the loader keeps its caches in.
CACHE_DIR_ENV = "DALI_LOADER_CACHE_DIR"


def cache_dir(kind: str) -> Path:
    """The folder of the cache directory that keeps indexes of ``kind`` (``"file-index"``,
    ``"tar-index"``); not made here."""
    if not kind or os.sep in kind or kind in (".", ".."):
        raise ValueError(f"kind must name one folder, like 'tar-index', got {kind!r}")
    base = os.environ.get(CACHE_DIR_ENV)
    if not base:
        home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(home, "dali-capture-loader")
    return Path(base) / kind
