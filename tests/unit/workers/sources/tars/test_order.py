"""Epoch orders of tar shards: a permutation per epoch, groups of shards, each worker's piece."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests import tar_pipelines as T
from workers.sources.plan._epoch_order import EpochOrder, orders_at
from workers.sources.tars._order import TarOrder
from workers.sources.tars._shards import open_shards


@pytest.mark.parametrize("window", [1, 2, 3, 5])
def test_a_window_order_is_a_permutation_fixed_by_seed_and_epoch(
    tmp_path: Path, window: int
) -> None:
    T.write_id_tars(tmp_path, 30, 7)
    shards = open_shards(str(tmp_path / "train-{000..004}.tar"), None, 0.0)
    assert shards.counts.tolist() == [7, 7, 7, 7, 2]
    positions = np.arange(30)
    order = TarOrder(shards, 1, 9, window).at(positions)
    assert sorted(order.tolist()) == list(range(30))
    assert order.tolist() == TarOrder(shards, 1, 9, window).at(positions).tolist()
    assert order.tolist() != TarOrder(shards, 2, 9, window).at(positions).tolist()
    # positions asked in pieces give the same samples
    pieces = np.concatenate(
        [TarOrder(shards, 1, 9, window).at(p) for p in (positions[:11], positions[11:])]
    )
    assert pieces.tolist() == order.tolist()
    # each group of ``window`` shards is a contiguous run of positions
    shard_of = order // 7
    groups = [set(shard_of[a:b].tolist()) for a, b in _runs(shard_of, window, shards.counts)]
    assert all(len(group) <= window for group in groups)


def test_the_orders_inside_groups_are_each_groups_own_epoch_order() -> None:
    """All groups permuted in one pass give what each group's own order gives (the order of a
    saved run must not move with how it is computed): group ``g`` of ``size`` samples starting
    at ``first`` holds ``first + EpochOrder(size, epoch, key_g).at(offset)``."""
    rng = np.random.default_rng(5)
    for _trial in range(20):
        sizes = rng.integers(1, 40, int(rng.integers(1, 60)))
        epoch, seed = int(rng.integers(0, 4)), int(rng.integers(0, 10**6))
        seeds = [int(s) for s in rng.integers(0, 2**32, len(sizes))]
        group = rng.integers(0, len(sizes), 500)
        offsets = np.array([int(rng.integers(0, sizes[g])) for g in group.tolist()])
        got = orders_at(sizes, seeds, epoch, group, offsets)
        expected = [
            int(EpochOrder(int(sizes[g]), epoch, seeds[g], True).at(np.array([o]))[0])
            for g, o in zip(group.tolist(), offsets.tolist(), strict=True)
        ]
        assert got.tolist() == expected, seed
    assert orders_at(np.array([3]), [1], 0, np.array([], int), np.array([], int)).size == 0


def _runs(shard_of: np.ndarray, window: int, counts: np.ndarray) -> list[tuple[int, int]]:
    """Split positions where the set of shards would exceed ``window`` (greedy)."""
    runs, start, seen = [], 0, set()
    for position, shard in enumerate(shard_of.tolist()):
        if shard not in seen and len(seen) == window:
            runs.append((start, position))
            start, seen = position, set()
        seen.add(shard)
    runs.append((start, len(shard_of)))
    return runs


@pytest.mark.parametrize(("ranks", "workers", "window"), [(1, 3, 2), (2, 4, 4), (3, 2, 1)])
def test_each_worker_reads_its_own_contiguous_piece_of_each_shard(
    tmp_path: Path, ranks: int, workers: int, window: int
) -> None:
    """Given the parts of the layout an epoch starts with, the order keeps each part's samples
    of a shard one contiguous run of it, and no two parts share a sample of a shard: each
    shard's bytes are read once per epoch, however many workers and ranks read it."""
    from workers import Sampling, plan_epoch
    from workers.sources.tars._order import TarOrders

    T.write_id_tars(tmp_path, 97, 9)  # 11 shards, the last one short
    shards = open_shards(str(tmp_path / "train-{000..010}.tar"), None, 0.0)
    orders = TarOrders(shards, 5, window)
    sampling = Sampling(97, 4, 5, True, False, "")
    plan = plan_epoch(sampling, 2, ranks * workers, None, orders, ranks=ranks)
    taken = []
    for batches in plan:
        real = np.concatenate([ids[: len(ids) - padded] for ids, padded in batches])
        taken += real.tolist()
        for shard in np.unique(real // 9).tolist():  # (ids of shard k: 9k .. 9k + 8)
            mine = np.sort(real[real // 9 == shard])
            assert mine.tolist() == list(range(int(mine[0]), int(mine[-1]) + 1))
        assert len(set((real // 9).tolist())) <= -(-len(real) // 9) + 2 * window
    assert sorted(taken) == list(range(97))  # exactly once
    # the order a layout sets is kept: asked again for the same parts, the same samples
    again = plan_epoch(sampling, 2, ranks * workers, None, orders, ranks=ranks)
    assert all(
        [a.tolist() for a, _ in x] == [b.tolist() for b, _ in y]
        for x, y in zip(plan, again, strict=True)
    )
