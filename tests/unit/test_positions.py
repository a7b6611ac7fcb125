"""The position arithmetic behind resume and reshard (no processes, no DALI).

Exactly once is checked two ways: exhaustively at small sizes, against a plain reference that
materialises the whole epoch (every layout pair up to 8 shards, fresh, resharded, chained,
continued), and by sampling at large sizes (10**9 samples, 65,536 shards), where only a few
shards' batches can be built.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from workers import Position, Sampling, plan_epoch, shard_batches, steps_per_epoch
from workers._epoch_order import EpochOrder

Lists = list[list[tuple[Any, int]]]


def _real(batches: list[tuple[Any, int]]) -> list[int]:
    ids: list[int] = []
    for chunk, padded in batches:
        values = [int(v) for v in chunk]
        ids += values[: len(values) - padded]
    return ids


def _delivered(lists: Lists, received: Sequence[int] | None = None) -> list[int]:
    """The real samples of every shard's batches (only its first ``received`` ones, if given)."""
    counts = received if received is not None else [len(shard) for shard in lists]
    return [i for shard, done in zip(lists, counts, strict=True) for i in _real(shard[:done])]


def _received_at(lists: Lists, fraction: float) -> tuple[int, ...]:
    """Counts a round-robin trainer has received after ``fraction`` of the epoch's batches."""
    counts = [0] * len(lists)
    target = int(fraction * sum(len(b) for b in lists))
    cursor = 0
    while sum(counts) < target:
        if counts[cursor] < len(lists[cursor]):
            counts[cursor] += 1
        cursor = (cursor + 1) % len(lists)
    return tuple(counts)


def _plain(lists: Lists) -> list[list[tuple[list[int], int]]]:
    return [[([int(v) for v in chunk], padded) for chunk, padded in shard] for shard in lists]


# --------------------------------------------------------------------------- the reference
def _reference_layout(
    samples: list[int], count: int, batch: int, drop_last: bool
) -> list[list[tuple[list[int], int]]]:
    """``samples`` in ``count`` equal contiguous parts, padded with the first samples, cut into
    batches; the last partial batch is dropped or filled with repeats of its last sample."""
    per = len(samples) // count if drop_last else -(-len(samples) // count)
    lists = []
    for index in range(count):
        mine = samples[index * per : (index + 1) * per]
        real = len(mine)
        mine = mine + [samples[i % len(samples)] for i in range(per - real)]
        batches = []
        for start in range(0, per, batch):
            chunk = mine[start : start + batch]
            if len(chunk) < batch:
                if drop_last:
                    break
                chunk = chunk + [chunk[-1]] * (batch - len(chunk))
            batches.append((chunk, batch - max(0, min(batch, real - start))))
        lists.append(batches)
    return lists


def _reference_plan(
    sampling: Sampling, epoch: int, count: int, position: Position | None
) -> list[list[tuple[list[int], int]]]:
    """What ``plan_epoch`` must give, from the whole epoch's order held in a list."""
    order = EpochOrder(sampling.total, epoch, sampling.seed, sampling.shuffle)
    samples = order.at(np.arange(sampling.total)).tolist()
    batch = sampling.batch_size
    if position is None or position.epoch != epoch or not position.segments:
        return _reference_layout(samples, count, batch, sampling.drop_last)
    lists = _reference_layout(samples, position.segments[0][0], batch, sampling.drop_last)
    for k, (_, received) in enumerate(position.segments):
        last = k == len(position.segments) - 1
        if last and position.continues:
            return [shard[done:] for shard, done in zip(lists, received, strict=True)]
        left = [
            i
            for shard, done in zip(lists, received, strict=True)
            for chunk, padded in shard[done:]
            for i in chunk[: batch - padded]
        ]
        next_count = count if last else position.segments[k + 1][0]
        lists = _reference_layout(left, next_count, batch, False)
    return lists


_checked = itertools.count()


def _check(sampling: Sampling, epoch: int, count: int, position: Position | None) -> Lists:
    """``plan_epoch`` equals the reference (and so does one shard's ``shard_batches``, a
    different one at each call), and every new shard has the same number of full batches."""
    plan = plan_epoch(sampling, epoch, count, position)
    expected = _reference_plan(sampling, epoch, count, position)
    assert _plain(plan) == expected, (sampling, count, position)
    index = next(_checked) % count
    assert _plain([shard_batches(sampling, epoch, index, count, position)]) == [expected[index]]
    if position is None or not position.continues:
        assert len({len(shard) for shard in plan}) <= 1, "every shard the same steps"
    assert all(len(chunk) == sampling.batch_size for shard in plan for chunk, _ in shard)
    return plan


def _resume(sampling: Sampling, before: Lists, received: tuple[int, ...], new: int) -> None:
    """A run of ``before``'s layout stopped at ``received`` and resumed on ``new`` shards
    delivers what the uninterrupted epoch would have, once, as the reference says."""
    epoch = 2
    after = _check(sampling, epoch, new, Position(epoch, ((len(before), received),)))
    assert sorted(_delivered(before, received) + _delivered(after)) == sorted(_delivered(before))


# --------------------------------------------------------------------------- small, exhaustive
PAIRS = list(itertools.product(range(1, 9), range(1, 9)))


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [True, False])
def test_every_layout_pair_up_to_8_shards_delivers_every_sample_once(
    shuffle: bool, drop_last: bool
) -> None:
    rng = random.Random(11)
    for (old, new), (total, batch) in itertools.product(PAIRS, [(13, 3), (37, 8)]):
        if drop_last and total < old:
            continue
        sampling = Sampling(total, batch, 5, shuffle, drop_last)
        before = _check(sampling, 2, old, None)
        if not drop_last:
            assert sorted(_delivered(before)) == list(range(total))
        steps = len(before[0])
        for received in [(0,) * old, (steps,) * old]:
            _resume(sampling, before, received, new)
        _resume(sampling, before, tuple(rng.randint(0, steps) for _ in range(old)), new)


@pytest.mark.parametrize("total", [1, 5, 11])
def test_every_position_of_small_layouts_delivers_every_sample_once(total: int) -> None:
    for old, new, batch, drop_last in itertools.product([1, 2, 3], [1, 2, 4], [2, 3], [0, 1]):
        if drop_last and total < old:
            continue
        sampling = Sampling(total, batch, 1, True, bool(drop_last))
        before = plan_epoch(sampling, 2, old, None)
        for received in itertools.product(range(len(before[0]) + 1), repeat=old):
            _resume(sampling, before, received, new)


CASES = list(
    itertools.product(
        [1, 7, 30, 64, 101],  # total
        [1, 4, 8],  # batch size
        [1, 2, 3, 4],  # old shards
        [1, 2, 3, 4, 6],  # new shards
        [0.0, 0.35, 0.9, 1.0],  # position in the epoch
        [False, True],  # drop_last
    )
)


@pytest.mark.parametrize("chunk", range(4))
def test_a_resharded_epoch_delivers_every_sample_once_with_equal_steps(chunk: int) -> None:
    for case in CASES[chunk::4]:
        total, batch, old, new, where, drop_last = case
        if drop_last and total < old:
            continue
        sampling = Sampling(total, batch, 5, True, drop_last)
        before = plan_epoch(sampling, 2, old, None)
        uninterrupted = sorted(_delivered(before))
        received = _received_at(before, where)
        consumed = _delivered(before, received)
        position = Position(2, ((old, received),), continues=False)
        after = plan_epoch(sampling, 2, new, position)
        assert len({len(shard) for shard in after}) <= 1, "every new shard the same steps"
        assert sorted(consumed + _delivered(after)) == uninterrupted, case
        assert all(len(chunk_) == batch for shard in after for chunk_, _ in shard)


def test_same_layout_continues_each_shard_where_it_stopped() -> None:
    for shuffle, drop_last in itertools.product([True, False], [True, False]):
        sampling = Sampling(50, 4, 1, shuffle, drop_last)
        before = plan_epoch(sampling, 0, 3, None)
        for received in itertools.product(range(len(before[0]) + 1), repeat=3):
            after = _check(sampling, 0, 3, Position(0, ((3, received),), continues=True))
            for shard, done, rest in zip(before, received, after, strict=True):
                assert _plain([shard[done:]]) == _plain([rest])


def test_a_continued_reshard_continues_the_resharded_batches() -> None:
    sampling = Sampling(61, 4, 2, True, True)
    first = ((5, (2, 0, 3, 1, 3)),)
    resharded = plan_epoch(sampling, 1, 3, Position(1, first))
    received = (1, 3, 2)
    after = _check(sampling, 1, 3, Position(1, (*first, (3, received)), continues=True))
    for shard, done, rest in zip(resharded, received, after, strict=True):
        assert _plain([shard[done:]]) == _plain([rest])


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
def test_chained_resumes_on_changing_layouts_stay_exactly_once(
    shuffle: bool, drop_last: bool
) -> None:
    rng = random.Random(3)
    for _ in range(60):
        total, batch = rng.randint(1, 90), rng.randint(1, 6)
        sampling = Sampling(total, batch, 9, shuffle, drop_last)
        layouts = [rng.randint(1, 8) for _ in range(rng.randint(2, 4))]
        if drop_last and total < layouts[0]:
            continue
        segments: list[tuple[int, tuple[int, ...]]] = []
        consumed: list[int] = []
        lists = _check(sampling, 1, layouts[0], None)
        uninterrupted = sorted(_delivered(lists))
        for k, count in enumerate(layouts):
            if k:
                lists = _check(sampling, 1, count, Position(1, tuple(segments)))
            received = _received_at(lists, rng.random())
            consumed += _delivered(lists, received)
            segments.append((count, received))
        rest = _check(sampling, 1, 2, Position(1, tuple(segments), continues=False))
        assert sorted(consumed + _delivered(rest)) == uninterrupted


def test_a_position_of_another_epoch_is_ignored() -> None:
    sampling = Sampling(20, 4, 0, True, False)
    fresh = plan_epoch(sampling, 3, 2, None)
    other = plan_epoch(sampling, 3, 2, Position(2, ((2, (1, 1)),), continues=True))
    assert _plain(fresh) == _plain(other)


def test_a_continued_position_must_keep_its_layout() -> None:
    sampling = Sampling(20, 4, 0, True, False)
    with pytest.raises(ValueError, match="continues a layout of 2 shards, not 3"):
        plan_epoch(sampling, 0, 3, Position(0, ((2, (1, 1)),), continues=True))


def test_a_layout_that_leaves_a_shard_without_samples_is_refused_with_drop_last() -> None:
    with pytest.raises(ValueError, match="3 samples cannot give every one of 4 shards"):
        plan_epoch(Sampling(3, 1, 0, True, True), 0, 4, None)
    with pytest.raises(ValueError, match=r"shard 4 is not in \[0, 4\)"):
        shard_batches(Sampling(30, 1, 0, True, True), 0, 4, 4, None)


# --------------------------------------------------------------------------- the order
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
    sampling = Sampling(10, 3, 1, False, False)
    assert _delivered(plan_epoch(sampling, 0, 2, None)) == list(range(10))


def test_a_shuffled_order_looks_random() -> None:
    """Neither the identity nor close to it: no correlation with the position, few fixed points,
    and consecutive positions land far apart."""
    positions = np.arange(100_000)
    for seed, epoch in [(0, 0), (1, 0), (0, 1), (99, 7)]:
        ids = EpochOrder(len(positions), epoch, seed, True).at(positions)
        assert abs(np.corrcoef(positions, ids)[0, 1]) < 0.02
        assert np.count_nonzero(ids == positions) < 10
        assert np.median(np.abs(np.diff(ids))) > 10_000


# --------------------------------------------------------------------------- large, sampled
BILLION = Sampling(10**9, 256, 17, True, False)


def test_a_shard_computes_the_samples_of_its_own_batches_and_no_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    evaluated: list[int] = []
    at = EpochOrder.at

    def counting(self: EpochOrder, positions: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        evaluated.append(len(positions))
        return at(self, positions)

    monkeypatch.setattr(EpochOrder, "at", counting)
    batches = shard_batches(BILLION, 0, 5, 65_536, None)
    assert sum(evaluated) == 15_259  # the shard's samples; its last batch fills with repeats
    evaluated.clear()
    received = (7,) * 65_536
    rest = shard_batches(BILLION, 0, 5, 65_536, Position(0, ((65_536, received),), True))
    assert _plain([rest]) == _plain([batches[7:]])
    assert sum(evaluated) == 15_259 - 7 * 256


def test_a_shard_of_a_trillion_samples_is_planned() -> None:
    sampling = Sampling(10**12, 1000, 3, True, True)
    batches = shard_batches(sampling, 0, 123_456, 10**8, None)
    assert len(batches) == 10 and all(padded == 0 for _, padded in batches)
    ids = np.concatenate([chunk for chunk, _ in batches])
    assert len(np.unique(ids)) == 10_000 and ids.max() < 10**12


def _ids(batches: list[tuple[Any, int]]) -> np.ndarray[Any, Any]:
    """The real samples of ``batches``, in order."""
    parts = [chunk[: len(chunk) - padded] for chunk, padded in batches]
    return np.concatenate(parts) if parts else np.empty(0, np.int64)


def test_shards_of_a_billion_samples_are_disjoint_and_complete() -> None:
    count = 65_536
    steps = steps_per_epoch(BILLION.total, count, 256, False)
    shards = [0, 1, 2, 40_000, count - 2, count - 1]
    plans = {index: shard_batches(BILLION, 0, index, count, None) for index in shards}
    for index, batches in plans.items():
        assert len(batches) == steps == 60
        assert all(len(chunk) == 256 for chunk, _ in batches)
        real = min(15_259, BILLION.total - index * 15_259)
        assert sum(256 - padded for _, padded in batches) == real
    ids = np.concatenate([_ids(batches) for batches in plans.values()])
    assert ids.min() >= 0 and ids.max() < BILLION.total
    assert len(np.unique(ids)) == len(ids)


def _left(layout: int, received: np.ndarray[Any, Any], per: int, steps: int) -> Any:
    """Real samples each shard of a fresh layout still owes after ``received`` (no drop_last)."""
    real = np.clip(BILLION.total - np.arange(layout) * per, 0, per)
    return real - np.minimum(np.minimum(received, steps) * 256, real)


def test_a_reshard_of_a_billion_samples_takes_the_old_shards_remaining_samples_in_order() -> None:
    old, new = 65_536, 32_768
    rng = np.random.default_rng(5)
    received = rng.integers(0, 61, old)
    segment = ((old, tuple(received.tolist())),)
    left = _left(old, received, 15_259, 60)
    per = -(-int(left.sum()) // new)
    starts = np.concatenate([[0], np.cumsum(left)])
    seen: list[np.ndarray[Any, Any]] = []
    for index in [0, 1, 12_345, new - 2, new - 1]:
        mine = _ids(shard_batches(BILLION, 0, index, new, Position(0, segment)))
        seen.append(mine)
        # the old shards whose remaining samples make up this new shard, continued on their layout
        first, last = index * per, min((index + 1) * per, int(left.sum()))
        owners = range(int(np.searchsorted(starts, first, "right")) - 1, old)
        expected = [np.empty(0, np.int64)]
        for owner in owners:
            if starts[owner] >= last:
                break
            continued = Position(0, segment, continues=True)
            rest = _ids(shard_batches(BILLION, 0, owner, old, continued))
            expected.append(rest[max(0, first - starts[owner]) : last - starts[owner]])
        assert np.array_equal(mine, np.concatenate(expected)), index
    ids = np.concatenate(seen)
    assert len(np.unique(ids)) == len(ids) and ids.max() < BILLION.total


def test_chained_reshards_of_a_billion_samples_stay_disjoint() -> None:
    rng = np.random.default_rng(8)
    segments: tuple[tuple[int, tuple[int, ...]], ...] = ()
    consumed: list[np.ndarray[Any, Any]] = []
    for count in [65_536, 32_768, 1_000]:
        position = Position(0, segments) if segments else None
        steps = len(shard_batches(BILLION, 0, 0, count, position))
        received = rng.integers(0, steps + 1, count)
        for index in [0, count // 2, count - 1]:
            batches = shard_batches(BILLION, 0, index, count, position)
            consumed.append(_ids(batches[: received[index]]))
        segments = (*segments, (count, tuple(received.tolist())))
    final = Position(0, segments)
    for index in [0, 3, 999]:
        consumed.append(_ids(shard_batches(BILLION, 0, index, 1_000, final)))
    ids = np.concatenate(consumed)
    assert len(np.unique(ids)) == len(ids) and ids.min() >= 0 and ids.max() < BILLION.total
