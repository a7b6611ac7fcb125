"""CUDA IPC slot ring between two processes (skipped without a GPU and CuPy; no DALI needed)."""

from __future__ import annotations

import pytest

cupy = pytest.importorskip("cupy")
try:
    HAVE_GPU = cupy.cuda.runtime.getDeviceCount() > 0
except Exception:
    HAVE_GPU = False
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAVE_GPU, reason="needs an NVIDIA GPU")]

from tests.gpu._exporter import run_ring  # noqa: E402


def test_fills_arrive_intact_and_slots_are_reused() -> None:
    run_ring(nbytes=3 * 2**20 + 7, batches=40, num_slots=3)
