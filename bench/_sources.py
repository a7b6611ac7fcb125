"""Worker-side functions for the benchmarks (spawned workers import them by name)."""

from __future__ import annotations

from typing import Any

import numpy as np

from loader import Shard


class RepeatBatch:
    """Yields the same prebuilt DALI batch ``count`` times per epoch (no data work at all)."""

    def __init__(self, shape: tuple[int, ...], dtype: str, batch_size: int, count: int) -> None:
        import nvidia.dali.experimental.dynamic as ndd

        sample = np.random.default_rng(0).random(shape).astype(dtype)
        self.batch = ndd.batch([sample] * batch_size)
        self.count = count

    def __iter__(self) -> Any:
        for _ in range(self.count):
            yield self.batch


def repeat_source(
    shard: Shard, shape: tuple[int, ...], dtype: str, batch_size: int, count: int
) -> Any:
    import nvidia.dali.experimental.dynamic as ndd

    return ndd.ExternalSource(RepeatBatch(shape, dtype, batch_size, count), cycle="raise")


def identity_step(batch: Any) -> dict[str, Any]:
    return {"x": batch}


class RepeatDataset:
    """A torch map-style dataset returning the same batch tensor every time."""

    def __init__(self, shape: tuple[int, ...], dtype: str, batch_size: int, count: int) -> None:
        self.shape, self.dtype, self.batch_size, self.count = shape, dtype, batch_size, count
        self._batch: Any = None

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> Any:
        import torch

        if self._batch is None:
            sample = np.random.default_rng(0).random(self.shape).astype(self.dtype)
            self._batch = torch.from_numpy(np.stack([sample] * self.batch_size))
        return self._batch


def files_source(shard: Shard, root: str, batch_size: int) -> Any:
    """The images workload over ``sharded_files`` instead of DALI's file reader."""
    from loader import sharded_files

    return sharded_files(shard, root, batch_size=batch_size, shuffle=True)


def labels_step(data: Any, labels: Any) -> dict[str, Any]:
    """``sharded_files``'s labels alone (for folders of empty files: nothing to decode)."""
    import nvidia.dali.experimental.dynamic as ndd

    return {"label": ndd.cast(labels, dtype=ndd.int32)}


def _id_sample(index: int) -> Any:
    return np.array([index], dtype=np.int64)


def soak_source(shard: Shard, total: int, batch_size: int) -> Any:
    from loader import sharded_source

    return sharded_source(shard, total, _id_sample, batch_size, shuffle=True)


def soak_step(ids: Any) -> dict[str, Any]:
    import nvidia.dali.experimental.dynamic as ndd

    return {"id": ndd.cast(ids, dtype=ndd.int64)}


# ------------------------------------------------------------------- bench suite workloads
PY_BATCH = 64
PY_SAMPLE = 256


def python_work(iteration: int) -> list[np.ndarray[Any, Any]]:
    """About 5 ms of numpy work (single-threaded) that makes one batch of 64 samples."""
    rng = np.random.default_rng(iteration)
    data = rng.random(120_000)
    data.sort()
    base = data[: PY_BATCH * PY_SAMPLE].reshape(PY_BATCH, PY_SAMPLE).astype(np.float32)
    return list(base)


class PythonBatches:
    """ExternalSource source: ``count`` batches per epoch, each from ``python_work``."""

    def __init__(self, count: int, offset: int = 0) -> None:
        self.count = count
        self.offset = offset

    def __iter__(self) -> Any:
        import nvidia.dali.experimental.dynamic as ndd

        for i in range(self.count):
            yield ndd.batch(python_work(self.offset + i))


def python_source(shard: Shard, batches: int) -> Any:
    import nvidia.dali.experimental.dynamic as ndd

    mine = batches // shard.count
    return ndd.ExternalSource(PythonBatches(mine, shard.index * mine), cycle="raise")


def light_step(batch: Any) -> dict[str, Any]:
    import nvidia.dali.experimental.dynamic as ndd

    return {"x": ndd.normalize(batch, axes=[0])}


class ParallelCallback:
    """DALI classic ``fn.external_source(parallel=True, batch=True, batch_info=True)`` callback."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __call__(self, info: Any) -> list[np.ndarray[Any, Any]]:
        if info.iteration >= self.count:
            raise StopIteration
        return python_work(info.iteration)


TINY_BATCH = 8


class TinyBatches:
    def __init__(self, count: int) -> None:
        self.count = count
        self.samples = [np.full((4, 4), i, dtype=np.uint8) for i in range(TINY_BATCH)]

    def __iter__(self) -> Any:
        import nvidia.dali.experimental.dynamic as ndd

        for _ in range(self.count):
            yield ndd.batch(self.samples)


def tiny_source(shard: Shard, batches: int) -> Any:
    import nvidia.dali.experimental.dynamic as ndd

    return ndd.ExternalSource(TinyBatches(batches // shard.count), cycle="raise")


def tiny_step(batch: Any) -> dict[str, Any]:
    import nvidia.dali.experimental.dynamic as ndd

    return {"x": ndd.cast(batch, dtype=ndd.uint8)}


class DaliEagerDataset:
    """torch map-style dataset: item i is batch i, made by the same DALI body run eagerly.

    ``kind`` is ``images`` (files of batch i -> image_step), ``python`` or ``tiny``.
    """

    def __init__(self, kind: str, batches: int, root: str = "", batch_size: int = 64) -> None:
        self.kind, self.batches, self.root, self.batch_size = kind, batches, root, batch_size
        self._ctx: Any = None
        self._files: list[str] = []

    def __len__(self) -> int:
        return self.batches

    def __getitem__(self, index: int) -> dict[str, np.ndarray[Any, Any]]:
        import nvidia.dali.experimental.dynamic as ndd

        from loader import list_images
        from loader.sample import image_step

        if self._ctx is None:
            self._ctx = ndd.EvalContext(num_threads=1)
            if self.kind == "images":
                self._files = list_images(self.root)[0]
        with self._ctx:
            if self.kind == "images":
                start = index * self.batch_size
                names = [
                    self._files[(start + k) % len(self._files)] for k in range(self.batch_size)
                ]
                jpegs = ndd.batch([np.fromfile(name, dtype=np.uint8) for name in names])
                labels = ndd.batch([np.array([k], dtype=np.int32) for k in range(self.batch_size)])
                out = image_step(jpegs, labels)
            elif self.kind == "python":
                out = light_step(ndd.batch(python_work(index)))
            else:
                out = tiny_step(
                    ndd.batch([np.full((4, 4), i, np.uint8) for i in range(TINY_BATCH)])
                )
            return {name: np.asarray(ndd.as_tensor(value)) for name, value in out.items()}


# ------------------------------------------------------------------- heavy-tail workload
def heavy_tail_seconds(index: int) -> float:
    """A sample's load time: 0.2 ms, or 100 ms for 1% of the samples (fixed per sample id)."""
    return 0.1 if np.random.default_rng([7, index]).random() < 0.01 else 0.0002


def _heavy_tail_sample(index: int) -> Any:
    import time

    time.sleep(heavy_tail_seconds(index))
    return np.full(64, index % 251, dtype=np.uint8)


def heavy_tail_source(shard: Shard, total: int, batch_size: int) -> Any:
    from loader import sharded_source

    return sharded_source(shard, total, _heavy_tail_sample, batch_size, shuffle=True)


class PillowImageDataset:
    """What most users run: a map-style dataset decoding with Pillow, then random-resized-crop
    (scale 0.08-1, ratio 3/4-4/3), flip and normalize in numpy, CHW float32 (torchvision's
    recipe); torch's DataLoader batches it."""

    MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32) * 255
    STD = np.array([0.229, 0.224, 0.225], dtype=np.float32) * 255

    def __init__(self, root: str, size: int = 224) -> None:
        from loader import list_images

        self.files, self.labels = list_images(root)
        self.size = size

    def __len__(self) -> int:
        return len(self.files)

    def _box(self, rng: np.random.Generator, width: int, height: int) -> tuple[int, ...]:
        area = width * height
        for _ in range(10):
            target = area * rng.uniform(0.08, 1.0)
            ratio = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
            w, h = round((target * ratio) ** 0.5), round((target / ratio) ** 0.5)
            if 0 < w <= width and 0 < h <= height:
                x, y = int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1))
                return (x, y, x + w, y + h)
        return (0, 0, width, height)

    def __getitem__(self, index: int) -> tuple[np.ndarray[Any, Any], int]:
        from PIL import Image

        rng = np.random.default_rng()
        with Image.open(self.files[index]) as image:
            image = image.convert("RGB")
            box = self._box(rng, *image.size)
            crop = image.resize((self.size, self.size), Image.Resampling.BILINEAR, box=box)
        pixels = np.asarray(crop, dtype=np.float32)
        if rng.random() < 0.5:
            pixels = pixels[:, ::-1]
        pixels = (pixels - self.MEAN) / self.STD
        return np.ascontiguousarray(pixels.transpose(2, 0, 1)), self.labels[index]
