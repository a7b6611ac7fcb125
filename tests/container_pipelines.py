"""Module-level sources for the container tests (workers import them): one whose ``load``
takes far more memory at one sample than a container allows, and one with large samples."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from loader import Shard, sharded_source

#: The sample whose ``load`` takes :data:`HOG_BYTES` (written to, so the pages are real).
HOG_SAMPLE = 9
HOG_BYTES = 3 * 2**30


def _hungry_sample(index: int) -> Any:
    if index == HOG_SAMPLE:
        hog = np.ones(HOG_BYTES, dtype=np.uint8)  # every page touched: charged to the cgroup
        return np.array([index + int(hog[-1]) - 1], dtype=np.int64)
    return np.array([index], dtype=np.int64)


def hungry_source(shard: Shard, total: int = 32, batch_size: int = 4) -> Any:
    """sharded_source over ``total`` ids whose sample :data:`HOG_SAMPLE` needs 3 GiB."""
    return sharded_source(shard, total, _hungry_sample, batch_size)


def _large_sample(index: int, nbytes: int) -> Any:
    return np.full(nbytes, index % 251, dtype=np.uint8)


def large_source(shard: Shard, total: int = 64, batch_size: int = 4, nbytes: int = 2**24) -> Any:
    """sharded_source whose samples are ``nbytes`` each (16 MiB: a 64 MiB batch of 4)."""
    return sharded_source(shard, total, functools.partial(_large_sample, nbytes=nbytes), batch_size)
