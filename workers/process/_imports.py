"""Importing DALI in a worker without importing PyTorch on the way.

DALI 2.4's dynamic mode imports ``torch`` at module level only to name two type aliases
(``_device.py``, ``_type.py``); every runtime use imports it lazily. Importing torch is most of
DALI's import time (about 1.0 of 1.7 s on the 2-core machine), and a worker process pays it
before its first batch. While DALI is imported in a worker, ``import torch`` is made to fail, so
DALI falls back to its no-torch aliases; afterwards imports are untouched, and a source or step
that imports torch gets it as usual.

It helps only where torch is not imported already: a spawned worker imports the trainer's main
module first, so a main script with ``import torch`` at its top (as most training scripts have)
gains nothing there; with ``forkserver`` (the default) the worker server imports DALI and the
main module once for every worker (:mod:`workers.server`), and a server forked from a trainer
that imported torch has it already. ``DALI_LOADER_DEFER_TORCH=0`` turns it off.

:func:`warm_source_analysis` does, in the worker server, the part of a first trace that does not
run DALI: DALI 2.4's capture parses each file that calls an operator (libcst; 0.1-0.8 s per file
and process on the 2-core machine), and caches the result per file; parsed once in the server,
every forked worker finds it cached; and the result is kept on disk for the next process
(:mod:`workers.startup._analysis_cache`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any

from .. import startup

logger = logging.getLogger("loader")

#: The environment variable that turns the deferral off (``0``).
SWITCH = "DALI_LOADER_DEFER_TORCH"


#: The DALI releases whose dynamic mode was checked to import torch only for type aliases.
VERIFIED_DALI = ("2.4.",)
_DALI_DISTRIBUTIONS = ("nvidia-dali-cuda120", "nvidia-dali-cuda130", "nvidia-dali-cuda110")


def dali_verified() -> bool:
    """True when the installed DALI is a release the deferral was verified with."""
    for name in _DALI_DISTRIBUTIONS:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return version.startswith(VERIFIED_DALI)
    return False


class _TorchDeferred(importlib.abc.MetaPathFinder):
    """Fails ``import torch`` (and its submodules) while installed."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == "torch" or fullname.startswith("torch."):
            raise ImportError(f"{fullname} is imported later in a loader worker")
        return None


@contextlib.contextmanager
def torch_deferred() -> Iterator[None]:
    """Within the block, ``import torch`` fails unless torch is already imported. Does nothing
    when switched off (``DALI_LOADER_DEFER_TORCH=0``), with a DALI it was not verified with (see
    :data:`VERIFIED_DALI`), or when ``torchdata`` is installed: DALI then imports its torchdata
    nodes, which need torch."""
    if (
        "torch" in sys.modules
        or os.environ.get(SWITCH, "1") == "0"
        or not dali_verified()
        or importlib.util.find_spec("torchdata") is not None
    ):
        yield
        return
    finder = _TorchDeferred()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)


def import_dali_modules() -> None:
    """Import the worker's DALI-facing modules (and DALI) with torch deferred."""
    with torch_deferred():
        from . import _setup  # noqa: F401


#: numpy's submodules that numpy imports on their first use, which every worker's plan makes
#: (``np.random.SeedSequence`` orders an epoch; ``np.unique`` asks ``np.ma`` whether its array
#: is masked): ~0.01 s each per worker, between its fork and its Hello, unless the server has them.
NUMPY_ON_FIRST_USE = ("numpy.random", "numpy.ma")


#: DALI's modules that its first operator call imports (``_conditionals`` asks
#: ``_debug_mode`` whether a debug pipeline runs): in each worker's traced first step, unless the
#: server has them.
DALI_ON_FIRST_USE = ("nvidia.dali._debug_mode",)


def import_numpy_on_first_use() -> None:
    """Import :data:`NUMPY_ON_FIRST_USE` (in the worker server: its forks find them imported)."""
    for name in NUMPY_ON_FIRST_USE:
        importlib.import_module(name)


def import_dali_on_first_use() -> None:
    """Import :data:`DALI_ON_FIRST_USE` (in the worker server, with torch deferred); one a
    DALI release lacks is left to DALI."""
    with torch_deferred():
        for name in DALI_ON_FIRST_USE:
            with contextlib.suppress(ImportError):
                importlib.import_module(name)


def dali_files_traced() -> list[str]:
    """DALI's own files whose operator calls its capture analyses on a first trace
    (``ndd.batch`` runs a copy operator from ``_batch.py``)."""
    from nvidia.dali.experimental.dynamic import _batch

    return [str(_batch.__file__)]


def warm_source_analysis(files: Sequence[str]) -> list[str]:
    """Parse ``files`` the way DALI's capture does at a first trace, without running anything,
    so that processes forked afterwards find them in DALI's cache; a file analysed before, by
    any process of this user's, is loaded from the disk cache instead, and one parsed here is
    written to it (:mod:`workers.startup`). Only with the DALI release this was checked
    with (:data:`VERIFIED_DALI`); returns the files parsed or loaded."""
    if not dali_verified():
        return []
    try:
        from nvidia.dali.experimental.dynamic import _source_analysis
    except ImportError:
        return []
    parse = getattr(_source_analysis, "_get_module_info", None)
    if parse is None or not isinstance(getattr(_source_analysis, "_file_cache", None), dict):
        return []
    done = []
    for path in dict.fromkeys(files):
        if not path.endswith(".py") or not os.path.isfile(path):
            continue
        if startup.load_analysis(path, _source_analysis):
            done.append(path)
            continue
        try:
            if parse(compile("", path, "exec")) is None:
                continue
        except Exception:  # a file DALI cannot parse is parsed (and refused) at trace time
            logger.debug("source analysis of %s not warmed", path, exc_info=True)
            continue
        done.append(path)
        startup.store_analysis(path, _source_analysis)
    return done


def modules_of(*functions: Any) -> list[tuple[str, str | None]]:
    """(module name, source file) of each function (partials unwrapped), in order, once. What
    is not a function (a dataset definition given as the source: the library's code, which DALI
    never traces) is left out."""
    found: dict[str, str | None] = {}
    for function in functions:
        while isinstance(function, functools.partial):
            function = function.func
        if not callable(function):
            continue
        name = getattr(function, "__module__", None)
        if not isinstance(name, str) or name in found:
            continue
        path = getattr(sys.modules.get(name), "__file__", None)
        found[name] = path if isinstance(path, str) else None
    return list(found.items())


def warm_spawned_worker(*functions: Any) -> list[str]:
    """In a spawned worker (no server parsed anything for it): DALI's own traced files and those
    of the loader's ``functions``, loaded from the disk cache or parsed and kept there
    (:func:`warm_source_analysis`), so that the next spawned worker loads them."""
    files = [path for _, path in modules_of(*functions) if path]
    return warm_source_analysis([*dali_files_traced(), *files])


def prepare_worker_server(files: Sequence[str]) -> None:
    """What a worker server does before it forks any worker: import DALI and the worker's
    modules (torch deferred) and the parts of numpy its sources use on first use, and parse
    DALI's own traced files, the main module's and ``files`` for DALI's capture
    (:func:`warm_source_analysis`)."""
    with startup.span("import DALI"):
        import_dali_modules()
        import_numpy_on_first_use()
        import_dali_on_first_use()
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    with startup.span("DALI's source analysis"):
        warm_source_analysis([*dali_files_traced(), *([main] if main else []), *files])
