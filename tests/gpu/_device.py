"""Whether the GPU tests have a GPU. Without one they skip: no NVIDIA driver on the machine, or
a driver that finds no device. With one that fails -- a broken or mismatched driver, any other
error from CUDA -- they are not skipped: each fails with CUDA's error (``tests/gpu/conftest.py``).

A module imports CuPy first (``pytest.importorskip``: no CuPy, no GPU tests), then takes its
marks from :func:`gpu_marks`."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import pytest

#: ``cudaErrorNoDevice``: the driver is there and found no CUDA-capable device.
NO_DEVICE = 100
#: The NVIDIA driver's user-space library. Where it is missing, the CUDA runtime reports an
#: "insufficient" driver (``cudaErrorInsufficientDriver``, 35): that is no GPU, not a broken one.
DRIVER = "libcuda.so.1"

NEEDS = "needs an NVIDIA GPU"


@dataclass(frozen=True)
class Gpu:
    #: why the tests skip (no GPU), or None
    skip: str | None = None
    #: why they fail (a GPU whose CUDA fails), or None
    error: str | None = None


def driver_installed() -> bool:
    try:
        ctypes.CDLL(DRIVER)
    except OSError:
        return False
    return True


@functools.cache
def probe() -> Gpu:
    """Ask CUDA (through CuPy, which the caller imported) how many devices there are."""
    import cupy

    runtime = cupy.cuda.runtime
    try:
        count = int(runtime.getDeviceCount())
    except runtime.CUDARuntimeError as error:
        if error.status == NO_DEVICE:
            return Gpu(skip=f"{NEEDS} (the NVIDIA driver found no device: {error})")
        if not driver_installed():
            return Gpu(skip=f"{NEEDS} (no NVIDIA driver: {DRIVER} cannot be loaded)")
        return Gpu(error=f"CUDA fails with the NVIDIA driver installed: {error}")
    except Exception as error:  # (not a skip: whatever else went wrong fails the tests)
        return Gpu(error=f"counting the GPUs failed: {type(error).__name__}: {error}")
    return Gpu(skip=f"{NEEDS} (CUDA counts no device)") if count == 0 else Gpu()


def gpu_marks() -> list[pytest.MarkDecorator]:
    """A GPU test module's marks: ``gpu``, and a skip where there is no GPU."""
    found = probe()
    if found.skip is not None:
        return [pytest.mark.gpu, pytest.mark.skip(reason=found.skip)]
    return [pytest.mark.gpu]
