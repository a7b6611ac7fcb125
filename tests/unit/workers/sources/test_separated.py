"""A mixed source's later permutations kept apart from the ones before them (no workers)."""

from __future__ import annotations

import functools
from collections import Counter

import numpy as np

from workers import SamplesDataset, Shard
from workers.sources._mix import MixOrder, MixPlan, Mixture, source_seed
from workers.sources._separated import SeparatedOrder
from workers.sources.plan import EpochOrder


def test_a_turns_head_holds_none_of_the_previous_turns_tail_and_stays_a_permutation() -> None:
    total, before, after, kept = 1000, 150, 250, 200
    previous, base = EpochOrder(total, 0, 7, True), EpochOrder(total, 1, 7, True)
    tail = set(previous.at(np.arange(total - before, total)).tolist())
    assert tail & set(base.at(np.arange(after)).tolist())  # (the base order clashes: ~37 here)
    order = SeparatedOrder(base, previous, total, before, after, kept)
    everything = order.at(np.arange(total))
    assert sorted(everything.tolist()) == list(range(total))
    assert not tail & set(everything[:after].tolist())
    # (only a few positions moved; the last ``kept``, the next boundary's reach, among none)
    assert (everything != base.at(np.arange(total))).sum() <= 2 * len(tail)
    assert (everything[-kept:] == base.at(np.arange(total - kept, total))).all()
    again = SeparatedOrder(EpochOrder(total, 1, 7, True), previous, total, before, after, kept)
    assert (again.at(np.arange(total)) == everything).all()  # (every worker the same)


def _load(offset: int, index: int) -> np.ndarray:
    return np.array([offset + index])


def test_no_batch_of_a_mix_holds_a_sample_twice_where_its_sources_start_new_permutations() -> None:
    """Three sources of 20,000, 10,000 and 5,000 samples, drawn 9,333 each an epoch (the
    smaller ones run out within epochs): batches of 256 consecutive positions, three epochs.
    Without the separation, 20 batches of 328 held a sample twice."""
    sizes, batch = (20_000, 10_000, 5_000), 256
    shard = Shard(0, 1, rank=0, world_size=1, worker=0, num_workers=1, seed=5)
    opened = [
        SamplesDataset(n, functools.partial(_load, 10**6 * k)).open(shard, source_seed(5, name))
        for k, (n, name) in enumerate(zip(sizes, "abc", strict=True))
    ]
    counts = [9_334, 9_333, 9_333]
    mix = Mixture(["a", "b", "c"], opened, MixPlan(counts), 5, True, batch)
    twice = 0
    for epoch in range(3):
        ids = MixOrder(mix, epoch).at(np.arange(sum(counts)))
        for start in range(0, len(ids) - batch + 1, batch):
            chunk = ids[start : start + batch]
            twice += len(set(chunk.tolist())) < batch
        assert Counter(mix.source_of(ids).tolist()) == dict(enumerate(counts))
    assert twice == 0
