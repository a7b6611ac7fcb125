"""The Loader with device='gpu' and real DALI (skipped without a GPU, CuPy or DALI)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from tests.gpu._device import gpu_marks

pytest.importorskip("cupy")
pytest.importorskip("nvidia.dali")
# skipped without a GPU; a GPU whose CUDA fails fails them (tests/gpu/_device.py)
pytestmark = gpu_marks()

from loader import Loader  # noqa: E402
from tests import pipelines as P  # noqa: E402


@pytest.mark.parametrize("output", ["cupy", "torch"])
def test_decoded_gpu_batches_arrive_on_the_device(image_root: Path, output: str) -> None:
    if output == "torch":
        pytest.importorskip("torch")
    source = functools.partial(P.id_reader, root=str(image_root))
    with Loader(source, P.gpu_decode_step, batch_size=4, device="gpu", output=output) as loader:
        for _ in range(2):
            seen = []
            for batch in loader:
                image = batch["image"]
                assert tuple(image.shape) == (4, 3, 16, 16)
                seen += [int(v) for v in batch["id"].ravel().tolist()]
                del batch, image
            assert sorted(seen) == list(range(48))
