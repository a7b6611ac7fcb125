"""An epoch's seeded order (``workers.sources.plan._epoch_order``): a permutation at every size,
fixed by the seed and the epoch, random-looking."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from workers.sources.plan import EpochOrder, orders_at

Lists = list[list[tuple[Any, int]]]
Shape = tuple[int, int]  # (ranks, workers per rank)


@pytest.mark.parametrize("bits", range(0, 13))
def test_the_order_is_a_permutation_around_every_power_of_two(bits: int) -> None:
    for total in {max(1, 2**bits - 1), 2**bits, 2**bits + 1}:
        for seed, epoch in [(0, 0), (7, 3)]:
            ids = EpochOrder(total, epoch, seed, True).at(np.arange(total))
            assert ids.dtype == np.int64
            assert np.array_equal(np.sort(ids), np.arange(total)), total


@pytest.mark.parametrize("total", [2**20 - 1, 2**20, 2**20 + 1])
def test_the_order_is_a_permutation_at_a_million(total: int) -> None:
    ids = EpochOrder(total, 4, 123, True).at(np.arange(total))
    assert np.array_equal(np.sort(ids), np.arange(total))


def test_the_order_is_injective_on_a_sample_of_a_billion() -> None:
    total = 10**9
    positions = np.random.default_rng(0).choice(total, 300_000, replace=False)
    ids = EpochOrder(total, 1, 42, True).at(positions)
    assert ids.min() >= 0 and ids.max() < total
    assert len(np.unique(ids)) == len(positions)


def test_the_order_depends_on_the_seed_and_the_epoch_only() -> None:
    positions = np.arange(1000)
    orders = {
        (seed, epoch): EpochOrder(1000, epoch, seed, True).at(positions).tolist()
        for seed, epoch in itertools.product(range(4), range(4))
    }
    assert len({tuple(order) for order in orders.values()}) == len(orders)
    for (seed, epoch), order in orders.items():
        assert EpochOrder(1000, epoch, seed, True).at(positions).tolist() == order


def test_without_shuffle_the_order_is_the_identity() -> None:
    assert EpochOrder(10**9, 3, 1, False).at(np.arange(5, 9)).tolist() == [5, 6, 7, 8]


def test_a_shuffled_order_looks_random() -> None:
    """Neither the identity nor close to it: no correlation with the position, few fixed points,
    and consecutive positions land far apart."""
    positions = np.arange(100_000)
    for seed, epoch in [(0, 0), (1, 0), (0, 1), (99, 7)]:
        ids = EpochOrder(len(positions), epoch, seed, True).at(positions)
        assert abs(np.corrcoef(positions, ids)[0, 1]) < 0.02
        assert np.count_nonzero(ids == positions) < 10
        assert np.median(np.abs(np.diff(ids))) > 10_000


def test_many_orders_at_once_are_each_groups_own_epoch_order() -> None:
    totals = np.array([5, 1, 300, 17])
    seeds = [11, 12, 13, 14]
    group = np.array([0, 2, 2, 3, 1, 0, 2, 3])
    offsets = np.array([4, 0, 299, 16, 0, 1, 150, 3])
    together = orders_at(totals, seeds, 7, group, offsets)
    alone = [
        int(EpochOrder(int(totals[g]), 7, seeds[g], True).at(np.array([o]))[0])
        for g, o in zip(group.tolist(), offsets.tolist(), strict=True)
    ]
    assert together.tolist() == alone
    assert orders_at(totals, seeds, 7, group[:0], offsets[:0]).size == 0
    with pytest.raises(ValueError, match="empty"):
        orders_at(np.array([0]), [1], 0, np.array([0]), np.array([0]))
