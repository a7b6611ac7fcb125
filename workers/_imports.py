"""Importing DALI in a worker without importing PyTorch on the way.

DALI 2.4's dynamic mode imports ``torch`` at module level only to name two type aliases
(``_device.py``, ``_type.py``); every runtime use imports it lazily. Importing torch is most of
DALI's import time (about 1.0 of 1.7 s on the 2-core machine), and a worker process pays it
before its first batch. While DALI is imported in a worker, ``import torch`` is made to fail, so
DALI falls back to its no-torch aliases; afterwards imports are untouched, and a source or step
that imports torch gets it as usual.

It helps only where torch is not imported already: under ``spawn`` a worker imports the trainer's
main module first, and under ``forkserver`` on Python 3.11 every forked worker re-imports it too,
so a main script with ``import torch`` at its top (as most training scripts have) gains nothing.
``DALI_LOADER_DEFER_TORCH=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Iterator, Sequence
from types import ModuleType

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
        from . import _main  # noqa: F401
