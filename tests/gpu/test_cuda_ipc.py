"""CUDA IPC slot ring between two processes (skipped without a GPU and CuPy; no DALI needed)."""

from __future__ import annotations

import pytest

from tests.gpu._device import gpu_marks

pytest.importorskip("cupy")
# skipped without a GPU; a GPU whose CUDA fails fails them (tests/gpu/_device.py)
pytestmark = gpu_marks()

from tests.gpu._exporter import run_ring  # noqa: E402


def test_fills_arrive_intact_and_slots_are_reused() -> None:
    run_ring(nbytes=3 * 2**20 + 7, batches=40, num_slots=3)
