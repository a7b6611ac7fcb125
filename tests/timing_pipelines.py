"""Module-level sources for the timing, diagnosis and trace tests (workers import them)."""

from __future__ import annotations

import functools
import time
from typing import Any

import numpy as np
import nvidia.dali.experimental.dynamic as ndd

from loader import Shard, sharded_source


def _sleeping_sample(index: int, seconds: float) -> Any:
    time.sleep(seconds)
    return np.array([index], dtype=np.int64)


def sleeping_source(
    shard: Shard, total: int = 4096, batch_size: int = 8, seconds: float = 0.002
) -> Any:
    """sharded_source whose load sleeps ``seconds`` per sample: an input-bound pipeline whose
    load is off the CPU (as one that waits on storage)."""
    return sharded_source(
        shard, total, functools.partial(_sleeping_sample, seconds=seconds), batch_size
    )


def _quick_sample(index: int) -> Any:
    return np.array([index], dtype=np.int64)


def quick_source(shard: Shard, total: int = 4096, batch_size: int = 8) -> Any:
    """sharded_source whose load costs next to nothing."""
    return sharded_source(shard, total, _quick_sample, batch_size)


def id_step(ids: Any) -> dict[str, Any]:
    return {"id": ndd.cast(ids, dtype=ndd.int64)}
