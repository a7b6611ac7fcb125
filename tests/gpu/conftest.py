"""A GPU test on a machine whose CUDA fails fails before it starts, with CUDA's error (a machine
without a GPU skips them: ``tests/gpu/_device.py``)."""

from __future__ import annotations

import pytest

from tests.gpu._device import probe


@pytest.fixture(autouse=True)
def _cuda_works() -> None:
    error = probe().error
    if error is not None:
        pytest.fail(f"a GPU test cannot run: {error}", pytrace=False)
