"""The fetches ahead of remote shards: bounded in shards and in bytes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest


@pytest.mark.parametrize(
    ("ahead_bytes", "sizes", "fetched"),
    [
        (None, [10, 10, 10, 10, 10], [0, 1, 2, 3]),  # ahead=3 shards: the count alone
        (25, [10, 10, 10, 10, 10], [0, 1, 2]),  # 2 shards fit the budget
        (15, [10, 10, 10, 10, 10], [0, 1]),
        (15, [10, 100, 10, 10, 10], [0, 1]),  # the first shard ahead, whatever its size
        (1000, [1, 1, 1, 1, 1], [0, 1, 2, 3]),  # tiny shards: still no more than ahead=3
    ],
)
def test_read_ahead_is_bounded_in_shards_and_in_bytes_past_the_first(
    ahead_bytes: int | None, sizes: list[int], fetched: list[int]
) -> None:
    """``ahead`` (shards) and ``ahead_bytes`` bound what a worker fetches before it needs it;
    the shard the batch being loaded needs is fetched whatever the bounds."""
    from workers.sources.tars._fetch import Fetcher

    def fetch(shard: int, rows: Any) -> tuple[int, np.ndarray]:
        return 0, np.zeros(1, np.uint8)

    fetcher = Fetcher(fetch, 3, ahead_bytes, lambda shard, rows: sizes[shard])
    try:
        # shard k is first needed at step k and last at step k + 9 (a lead of 5 steps)
        fetcher.plan([(k, k, k + 9, np.arange(4)) for k in range(5)])
        assert sorted(fetcher._buffers) == fetched
    finally:
        fetcher.close()
