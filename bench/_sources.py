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


def _id_sample(index: int) -> Any:
    return np.array([index], dtype=np.int64)


def soak_source(shard: Shard, total: int, batch_size: int) -> Any:
    from loader import sharded_source

    return sharded_source(shard, total, _id_sample, batch_size, shuffle=True)


def soak_step(ids: Any) -> dict[str, Any]:
    import nvidia.dali.experimental.dynamic as ndd

    return {"id": ndd.cast(ids, dtype=ndd.int64)}
