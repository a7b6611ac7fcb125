"""The engine's decisions are tested without processes: every test here checks that it started
none, and the engine's modules import no DALI (when the run had not imported it before)."""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Iterator

import psutil
import pytest

_DALI_BEFORE = "nvidia.dali" in sys.modules
import loader.engine._coordinator  # noqa: E402, F401  (every engine module, through it)

#: DALI came in with the engine's modules (None: it was imported before, nothing to tell)
DALI_FROM_ENGINE = None if _DALI_BEFORE else "nvidia.dali" in sys.modules


@pytest.fixture(autouse=True)
def _no_process_started() -> Iterator[None]:
    me = psutil.Process()
    before = {child.pid for child in me.children(recursive=True)}
    active = set(multiprocessing.active_children())
    yield
    assert set(multiprocessing.active_children()) <= active
    assert {child.pid for child in me.children(recursive=True)} <= before
