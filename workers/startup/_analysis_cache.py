"""DALI's source analysis kept on disk, so that a new process loads it instead of parsing again.

DALI 2.4's capture parses, at a first trace, each file that calls an operator (libcst: its own
``_batch.py`` takes 0.6-0.8 s on the 2-core machine, a step's file 0.2-0.4 s), and keeps the
result in the process. The worker server does that once for all of its workers
(:func:`workers.process._imports.warm_source_analysis`), but every new job paid it again, and it was
the larger half of a job's wait for its first batch. This module keeps each file's result on disk,
as Python keeps bytecode in ``__pycache__``: one file per analysed text, named by a hash of that
text and of the DALI, libcst and Python versions, so an edited file, or another release, is parsed
afresh. Loading one takes 0.01-0.04 s.

Where: ``$DALI_LOADER_ANALYSIS_CACHE``, else ``$XDG_CACHE_HOME/dali-capture-loader/
source-analysis``, else ``~/.cache/dali-capture-loader/source-analysis`` (apart from
``DALI_LOADER_CACHE_DIR``, which may be a directory every node shares: this cache holds code's
analysis, not data). ``DALI_LOADER_ANALYSIS_CACHE=0`` turns it off. Results are pickles, and
loading a pickle runs code: a directory that is not this user's own, or that others may write
to, is neither read nor written. At most :data:`MAX_ENTRIES` files are kept; the least recently
used go first. Any failure (a full disk, a file cut short, a result that does not pickle) only
means the file is parsed, as without the cache.
"""

from __future__ import annotations

import contextlib
import copyreg
import functools
import hashlib
import importlib.metadata
import io
import linecache
import logging
import os
import pickle
import stat
import sys
import types
from pathlib import Path
from typing import Any

logger = logging.getLogger("loader")

#: Names the cache's directory; ``0`` turns the cache off.
CACHE_ENV = "DALI_LOADER_ANALYSIS_CACHE"
#: The most files kept (a few hundred kB each).
MAX_ENTRIES = 256
_SUFFIX = ".analysis"


def directory() -> Path | None:
    """The cache's directory, or None when it is turned off."""
    configured = os.environ.get(CACHE_ENV, "")
    if configured == "0":
        return None
    if configured:
        return Path(configured)
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(home) / "dali-capture-loader" / "source-analysis"


def usable_directory(create: bool) -> Path | None:
    """The cache's directory where it may be read (``create``: and written, made if missing);
    None when the cache is off or the directory is not this user's alone."""
    base = directory()
    return base if base is not None and _usable(base, create) else None


def _usable(path: Path, create: bool) -> bool:
    """Whether ``path`` is a directory of this user's that nobody else may write to."""
    if create:
        with contextlib.suppress(OSError):
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        info = path.stat()
    except OSError:
        return False
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        return False
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        logger.debug("source analysis cache %s is writable by others: not used", path)
        return False
    return True


@functools.lru_cache(maxsize=1)
def _versions() -> bytes:
    parts = [sys.version]
    for name in ("nvidia-dali-cuda120", "nvidia-dali-cuda130", "nvidia-dali-cuda110", "libcst"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            parts.append(f"{name}={importlib.metadata.version(name)}")
    return "\0".join(parts).encode()


def _entry_path(base: Path, text: str) -> Path:
    digest = hashlib.sha256(_versions() + b"\0" + text.encode("utf-8", "surrogatepass"))
    return base / (digest.hexdigest()[:40] + _SUFFIX)


def _mapping_proxy(content: dict[Any, Any]) -> types.MappingProxyType[Any, Any]:
    """Rebuilds a ``mappingproxy`` (libcst's metadata is one) when a result is loaded."""
    return types.MappingProxyType(content)


def _reduce_mapping_proxy(proxy: types.MappingProxyType[Any, Any]) -> tuple[Any, ...]:
    return _mapping_proxy, (dict(proxy),)


def load_analysis(path: str, analysis: types.ModuleType) -> bool:
    """Put the analysis of the file ``path`` from the cache where DALI's capture looks for it
    (``analysis``: DALI's ``_source_analysis`` module). True when it is there now, found in the
    process already or loaded; False when it must be parsed."""
    lines = linecache.getlines(path)  # (what DALI parses; it fills linecache's entry first)
    entry = linecache.cache.get(path)
    if not lines or entry is None:
        return False
    held = analysis._file_cache.get(path)
    if held is not None and held[0] is entry and held[1] is not None:
        return True
    base = usable_directory(create=False)
    if base is None:
        return False
    cached = _entry_path(base, "".join(lines))
    try:
        with open(cached, "rb") as file:
            info = pickle.load(file)
    except FileNotFoundError:
        return False
    except Exception:  # (cut short, or a release whose classes moved: parsed again)
        logger.debug("source analysis of %s: %s not loaded", path, cached, exc_info=True)
        return False
    if not isinstance(info, analysis.ModuleInfo):
        return False
    analysis._file_cache[path] = (entry, info)
    with contextlib.suppress(OSError):
        os.utime(cached)  # (used: kept longest)
    return True


def store_analysis(path: str, analysis: types.ModuleType) -> bool:
    """Write the analysis DALI holds for the file ``path`` to the cache (once parsed). True
    when it was written."""
    lines = linecache.getlines(path)
    held = analysis._file_cache.get(path)
    if not lines or held is None or held[1] is None or held[0] is not linecache.cache.get(path):
        return False
    base = usable_directory(create=True)
    if base is None:
        return False
    target = _entry_path(base, "".join(lines))
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = {  # (this pickler's only: the process's pickling is untouched)
        **copyreg.dispatch_table,
        types.MappingProxyType: _reduce_mapping_proxy,
    }
    try:
        pickler.dump(held[1])
    except (RecursionError, pickle.PicklingError, TypeError, AttributeError):
        logger.debug("source analysis of %s does not pickle: not cached", path, exc_info=True)
        return False
    if not write_whole(target, buffer.getbuffer()):
        logger.debug("source analysis of %s: not written to %s", path, base)
        return False
    prune(base)
    return True


def write_whole(target: Path, data: bytes | memoryview) -> bool:
    """Write ``data`` to ``target`` whole or not at all (a reader at the same time sees the old
    file or the new one); False when it could not be written."""
    partial = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    try:
        with open(partial, "wb") as file:
            file.write(data)
        os.replace(partial, target)
    except OSError:
        with contextlib.suppress(OSError):
            partial.unlink()
        return False
    return True


def prune(base: Path, suffix: str = _SUFFIX) -> None:
    """Keep the :data:`MAX_ENTRIES` files named ``*suffix`` used last."""
    try:
        entries = [(p.stat().st_mtime, p) for p in base.glob("*" + suffix)]
    except OSError:
        return
    if len(entries) <= MAX_ENTRIES:
        return
    entries.sort()
    for _, old in entries[: len(entries) - MAX_ENTRIES]:
        with contextlib.suppress(OSError):
            old.unlink()
