"""The position arithmetic behind resume and reshard (no processes, no DALI).

Exactly once is checked two ways: exhaustively at small sizes, against a plain reference that
materialises the whole epoch (every pair of layouts of up to 4 ranks and 8 shards, fresh,
resharded, chained, continued), and by sampling at large sizes (10**9 samples, 65,536 shards),
where only a few shards' batches can be built. A layout is ``(ranks, workers per rank)``; every
rank yields the same number of batches, its workers share them out whole, and only a rank's last
batch is padded.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from workers import Position, Sampling, plan_epoch, shard_batches, steps_per_epoch
from workers.sources.plan._epoch_order import EpochOrder

Lists = list[list[tuple[Any, int]]]
Shape = tuple[int, int]  # (ranks, workers per rank)


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


def _received_at(lists: Lists, fraction: float, workers: int | None = None) -> tuple[int, ...]:
    """Counts the round-robin trainers of every rank (``workers`` shards each; default: one
    rank) have received after ``fraction`` of the epoch's batches."""
    workers = workers or len(lists)
    counts = [0] * len(lists)
    for rank in range(len(lists) // workers):
        mine = lists[rank * workers : (rank + 1) * workers]
        target = int(fraction * sum(len(b) for b in mine))
        cursor, got = 0, 0
        while got < target:
            if counts[rank * workers + cursor] < len(mine[cursor]):
                counts[rank * workers + cursor] += 1
                got += 1
            cursor = (cursor + 1) % workers
    return tuple(counts)


def _plain(lists: Lists) -> list[list[tuple[list[int], int]]]:
    return [[([int(v) for v in chunk], padded) for chunk, padded in shard] for shard in lists]


def _fits(total: int, batch: int, shape: Shape, drop_last: bool) -> bool:
    """Whether ``shape`` can run a ``drop_last`` epoch: a full batch for every worker."""
    ranks, workers = shape
    return not drop_last or total // (ranks * batch) >= workers


# --------------------------------------------------------------------------- the reference
def _reference_layout(
    samples: list[int], shape: Shape, batch: int, drop_last: bool
) -> list[list[tuple[list[int], int]]]:
    """``samples`` in ``ranks`` contiguous parts as equal as can be (``drop_last``: full batches
    only), each cut into the same number of batches, dealt out whole to the rank's workers in
    order (the first ones one more); the rank's last batch is filled with repeats of its shard's
    last sample (or of the rank's first, or of the first of all)."""
    ranks, workers = shape
    steps = len(samples) // (ranks * batch) if drop_last else -(-len(samples) // (ranks * batch))
    if not steps:
        return [[] for _ in range(ranks * workers)]
    rank_steps = max(steps, workers)
    base, extra = divmod(len(samples), ranks)
    lists, first = [], 0
    for rank in range(ranks):
        share = steps * batch if drop_last else base + (rank < extra)
        part, first = samples[first : first + share], first + share
        start = 0
        for worker in range(workers):
            count = rank_steps // workers + (worker >= workers - rank_steps % workers)
            rows = part[start * batch : (start + count) * batch]
            real = len(rows)
            filler = rows[-1] if rows else part[0] if part else samples[0]
            rows = rows + [filler] * (count * batch - real)
            lists.append(
                [
                    (
                        rows[k * batch : (k + 1) * batch],
                        batch - max(0, min(batch, real - k * batch)),
                    )
                    for k in range(count)
                ]
            )
            start += count
    return lists


def _reference_plan(
    sampling: Sampling, epoch: int, shape: Shape, position: Position | None
) -> list[list[tuple[list[int], int]]]:
    """What ``plan_epoch`` must give, from the whole epoch's order held in a list."""
    order = EpochOrder(sampling.total, epoch, sampling.seed, sampling.shuffle)
    samples = order.at(np.arange(sampling.total)).tolist()
    batch = sampling.batch_size
    if position is None or position.epoch != epoch or not position.segments:
        return _reference_layout(samples, shape, batch, sampling.drop_last)
    segments = position.segments
    lists = _reference_layout(samples, _shape(segments[0]), batch, sampling.drop_last)
    for k, (_, received) in enumerate(segments):
        last = k == len(segments) - 1
        if last and position.continues:
            return [shard[done:] for shard, done in zip(lists, received, strict=True)]
        left = [
            i
            for shard, done in zip(lists, received, strict=True)
            for chunk, padded in shard[done:]
            for i in chunk[: batch - padded]
        ]
        lists = _reference_layout(left, shape if last else _shape(segments[k + 1]), batch, False)
    return lists


def _shape(segment: tuple[int, tuple[int, ...]]) -> Shape:
    ranks, received = segment
    return ranks, len(received) // ranks


def _plan(sampling: Sampling, epoch: int, shape: Shape, position: Position | None) -> Lists:
    ranks, workers = shape
    return plan_epoch(sampling, epoch, ranks * workers, position, ranks=ranks)


_checked = itertools.count()


def _check(sampling: Sampling, epoch: int, shape: Shape, position: Position | None) -> Lists:
    """``plan_epoch`` equals the reference (and so does one shard's ``shard_batches``, a
    different one at each call); every rank has the same number of full batches, and a fresh or
    resharded epoch pads only each rank's last batch."""
    ranks, workers = shape
    count = ranks * workers
    plan = _plan(sampling, epoch, shape, position)
    expected = _reference_plan(sampling, epoch, shape, position)
    assert _plain(plan) == expected, (sampling, shape, position)
    index = next(_checked) % count
    one = shard_batches(sampling, epoch, index, count, position, ranks=ranks)
    assert _plain([one]) == [expected[index]]
    assert all(len(chunk) == sampling.batch_size for shard in plan for chunk, _ in shard)
    if position is None or not position.continues:
        per_rank = [plan[r * workers : (r + 1) * workers] for r in range(ranks)]
        assert len({sum(len(shard) for shard in mine) for mine in per_rank}) == 1
        for mine in per_rank:
            steps = [len(shard) for shard in mine]
            assert max(steps) - min(steps) <= 1 and steps == sorted(steps)
        real = len(_delivered(plan))
        if -(-real // (ranks * sampling.batch_size)) >= workers:  # a batch for every worker
            for mine in per_rank:
                assert len([p for shard in mine for _, p in shard if p]) <= 1, "one padded"
            padded = sum(p for shard in plan for _, p in shard)
            assert padded <= ranks * sampling.batch_size - 1, (sampling, shape, position)
    return plan


def _resume(
    sampling: Sampling, before: Lists, old: Shape, received: tuple[int, ...], new: Shape
) -> None:
    """A run of ``before``'s layout stopped at ``received`` and resumed on ``new`` delivers what
    the uninterrupted epoch would have, once, as the reference says."""
    epoch = 2
    after = _check(sampling, epoch, new, Position(epoch, ((old[0], received),)))
    assert sorted(_delivered(before, received) + _delivered(after)) == sorted(_delivered(before))


# --------------------------------------------------------------------------- the numbers
@pytest.mark.parametrize("workers", [1, 2, 3, 4])
def test_80_samples_in_batches_of_16_on_one_rank_are_5_batches_without_padding(
    workers: int,
) -> None:
    plan = _plan(Sampling(80, 16, 0, True, False), 0, (1, workers), None)
    assert sum(len(shard) for shard in plan) == 5
    assert sum(p for shard in plan for _, p in shard) == 0
    assert sorted(_delivered(plan)) == list(range(80))


@pytest.mark.parametrize("workers", [1, 2, 3, 4])
def test_80_samples_on_2_ranks_pad_at_most_one_batch_per_rank(workers: int) -> None:
    plan = _plan(Sampling(80, 16, 0, True, False), 0, (2, workers), None)
    per_rank = [sum(len(s) for s in plan[r * workers : (r + 1) * workers]) for r in range(2)]
    assert per_rank[0] == per_rank[1] == max(3, workers)
    padded = sum(p for shard in plan for _, p in shard)
    assert padded <= 31 if workers <= 3 else padded == 2 * 4 * 16 - 80
    assert sorted(_delivered(plan)) == list(range(80))


def test_a_rank_with_fewer_batches_than_workers_gives_each_worker_one_batch() -> None:
    plan = _plan(Sampling(20, 16, 0, True, False), 0, (1, 3), None)  # 2 batches, 3 workers
    assert [len(shard) for shard in plan] == [1, 1, 1]
    assert [p for shard in plan for _, p in shard] == [0, 12, 16]
    assert sorted(_delivered(plan)) == list(range(20))


# --------------------------------------------------------------------------- small, exhaustive
SHAPES = [(r, w) for r in range(1, 5) for w in range(1, 5) if r * w <= 8]
PAIRS = list(itertools.product(SHAPES, SHAPES))


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [True, False])
def test_every_layout_pair_up_to_8_shards_delivers_every_sample_once(
    shuffle: bool, drop_last: bool
) -> None:
    rng = random.Random(11)
    for (old, new), (total, batch) in itertools.product(PAIRS, [(13, 3), (37, 8), (50, 2)]):
        if not _fits(total, batch, old, drop_last):
            continue
        sampling = Sampling(total, batch, 5, shuffle, drop_last)
        before = _check(sampling, 2, old, None)
        if not drop_last:
            assert sorted(_delivered(before)) == list(range(total))
        steps = [len(shard) for shard in before]
        for received in [(0,) * len(steps), tuple(steps)]:
            _resume(sampling, before, old, received, new)
        _resume(sampling, before, old, tuple(rng.randint(0, s) for s in steps), new)


@pytest.mark.parametrize("total", [1, 5, 11])
def test_every_position_of_small_layouts_delivers_every_sample_once(total: int) -> None:
    shapes = [(1, 1), (1, 2), (2, 1), (1, 3), (2, 2)]
    for old, new, batch, drop_last in itertools.product(shapes, shapes, [2, 3], [0, 1]):
        if not _fits(total, batch, old, bool(drop_last)):
            continue
        sampling = Sampling(total, batch, 1, True, bool(drop_last))
        before = _plan(sampling, 2, old, None)
        for received in itertools.product(*[range(len(shard) + 1) for shard in before]):
            _resume(sampling, before, old, received, new)


CASES = list(
    itertools.product(
        [1, 7, 30, 64, 101],  # total
        [1, 4, 8],  # batch size
        [(1, 1), (1, 2), (2, 1), (1, 4), (2, 2)],  # old layout
        [(1, 1), (1, 3), (2, 1), (2, 3), (3, 2)],  # new layout
        [0.0, 0.35, 0.9, 1.0],  # position in the epoch
        [False, True],  # drop_last
    )
)


@pytest.mark.parametrize("chunk", range(4))
def test_a_resharded_epoch_delivers_every_sample_once_with_equal_steps(chunk: int) -> None:
    for case in CASES[chunk::4]:
        total, batch, old, new, where, drop_last = case
        if not _fits(total, batch, old, drop_last):
            continue
        sampling = Sampling(total, batch, 5, True, drop_last)
        before = _plan(sampling, 2, old, None)
        uninterrupted = sorted(_delivered(before))
        received = _received_at(before, where, old[1])
        consumed = _delivered(before, received)
        after = _check(sampling, 2, new, Position(2, ((old[0], received),), continues=False))
        assert sorted(consumed + _delivered(after)) == uninterrupted, case


def test_same_layout_continues_each_shard_where_it_stopped() -> None:
    for shuffle, drop_last, shape in itertools.product(
        [True, False], [True, False], [(1, 3), (3, 1)]
    ):
        sampling = Sampling(50, 4, 1, shuffle, drop_last)
        before = _plan(sampling, 0, shape, None)
        for received in itertools.product(*[range(len(shard) + 1) for shard in before]):
            position = Position(0, ((shape[0], received),), continues=True)
            after = _check(sampling, 0, shape, position)
            for shard, done, rest in zip(before, received, after, strict=True):
                assert _plain([shard[done:]]) == _plain([rest])


def test_a_continued_reshard_continues_the_resharded_batches() -> None:
    sampling = Sampling(61, 4, 2, True, True)
    first = ((1, (2, 0, 3, 1, 3)),)
    resharded = _plan(sampling, 1, (3, 1), Position(1, first))
    received = (1, 2, 2)
    after = _check(sampling, 1, (3, 1), Position(1, (*first, (3, received)), continues=True))
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
        layouts = [rng.choice(SHAPES) for _ in range(rng.randint(2, 4))]
        if not _fits(total, batch, layouts[0], drop_last):
            continue
        segments: list[tuple[int, tuple[int, ...]]] = []
        consumed: list[int] = []
        lists = _check(sampling, 1, layouts[0], None)
        uninterrupted = sorted(_delivered(lists))
        for k, shape in enumerate(layouts):
            if k:
                lists = _check(sampling, 1, shape, Position(1, tuple(segments)))
            received = _received_at(lists, rng.random(), shape[1])
            consumed += _delivered(lists, received)
            segments.append((shape[0], received))
        rest = _check(sampling, 1, (2, 1), Position(1, tuple(segments), continues=False))
        assert sorted(consumed + _delivered(rest)) == uninterrupted


def test_a_position_of_another_epoch_is_ignored() -> None:
    sampling = Sampling(20, 4, 0, True, False)
    fresh = plan_epoch(sampling, 3, 2, None)
    other = plan_epoch(sampling, 3, 2, Position(2, ((1, (1, 1)),), continues=True))
    assert _plain(fresh) == _plain(other)


def test_a_continued_position_must_keep_its_layout() -> None:
    sampling = Sampling(20, 4, 0, True, False)
    with pytest.raises(ValueError, match=r"continues a layout of 2 shards on 1 rank\(s\), not 3"):
        plan_epoch(sampling, 0, 3, Position(0, ((1, (1, 1)),), continues=True))
    with pytest.raises(ValueError, match=r"2 shards on 2 rank\(s\), not 2 on 1"):
        plan_epoch(sampling, 0, 2, Position(0, ((2, (1, 1)),), continues=True))


def test_a_layout_without_a_full_batch_for_every_worker_is_refused_with_drop_last() -> None:
    with pytest.raises(ValueError, match=r"3 full batch.*fewer than its 4 workers.*at most 3"):
        plan_epoch(Sampling(3, 1, 0, True, True), 0, 4, None)
    with pytest.raises(ValueError, match=r"shard 4 is not in \[0, 4\)"):
        shard_batches(Sampling(30, 1, 0, True, True), 0, 4, 4, None)
    with pytest.raises(ValueError, match="3 shards cannot be split evenly among 2 ranks"):
        plan_epoch(Sampling(30, 1, 0, True, True), 0, 3, None, ranks=2)


# --------------------------------------------------------------------------- the order


# --------------------------------------------------------------------------- large, sampled
BILLION = Sampling(10**9, 256, 17, True, False)
RANKS, WORKERS = 8_192, 8  # 65,536 shards


def _billion_shard(index: int, ranks: int = RANKS, workers: int = WORKERS) -> tuple[int, int, int]:
    """Shard ``index`` of a fresh epoch of :data:`BILLION`: its first real item of the epoch's
    sequence, its real samples and its batches (the layout's rule, written out)."""
    total, batch = BILLION.total, BILLION.batch_size
    rank, worker = divmod(index, workers)
    base, extra = divmod(total, ranks)
    rank_first, share = rank * base + min(rank, extra), base + (rank < extra)
    steps = -(-total // (ranks * batch))
    each, more = divmod(steps, workers)
    first_step = worker * each + max(worker - (workers - more), 0)
    mine = each + (worker >= workers - more)
    first = min(first_step * batch, share)
    last = min((first_step + mine) * batch, share)
    return rank_first + first, last - first, mine


def test_a_shard_computes_the_samples_of_its_own_batches_and_no_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    evaluated: list[int] = []
    at = EpochOrder.at

    def counting(self: EpochOrder, positions: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        evaluated.append(len(positions))
        return at(self, positions)

    monkeypatch.setattr(EpochOrder, "at", counting)
    count = RANKS * WORKERS
    index = WORKERS - 1  # the last worker of rank 0: the rank's last, padded batch
    _first, real, steps = _billion_shard(index)
    batches = shard_batches(BILLION, 0, index, count, None, ranks=RANKS)
    assert len(batches) == steps and real < steps * 256
    assert sum(evaluated) == real + 1  # its samples, and the one its last batch repeats
    evaluated.clear()
    received = (7,) * count
    position = Position(0, ((RANKS, received),), True)
    rest = shard_batches(BILLION, 0, index, count, position, ranks=RANKS)
    assert _plain([rest]) == _plain([batches[7:]])
    assert sum(evaluated) == real - 7 * 256 + 1


def test_a_shard_of_a_trillion_samples_is_planned() -> None:
    sampling = Sampling(10**12, 1000, 3, True, True)
    batches = shard_batches(sampling, 0, 123_456, 10**8, None, ranks=10**7)
    assert len(batches) == 10 and all(padded == 0 for _, padded in batches)
    ids = np.concatenate([chunk for chunk, _ in batches])
    assert len(np.unique(ids)) == 10_000 and ids.max() < 10**12


def _ids(batches: list[tuple[Any, int]]) -> np.ndarray[Any, Any]:
    """The real samples of ``batches``, in order."""
    parts = [chunk[: len(chunk) - padded] for chunk, padded in batches]
    return np.concatenate(parts) if parts else np.empty(0, np.int64)


def test_shards_of_a_billion_samples_are_disjoint_and_complete() -> None:
    count = RANKS * WORKERS
    steps = steps_per_epoch(BILLION.total, count, 256, False, RANKS)
    assert steps == -(-BILLION.total // (RANKS * 256))
    shards = [0, 1, 2, 7, 40_000, 40_007, count - 2, count - 1]
    plans = {index: shard_batches(BILLION, 0, index, count, None, ranks=RANKS) for index in shards}
    order = EpochOrder(BILLION.total, 0, BILLION.seed, True)
    for index, batches in plans.items():
        first, real, mine = _billion_shard(index)
        assert len(batches) == mine and mine in (steps // WORKERS, steps // WORKERS + 1)
        assert all(len(chunk) == 256 for chunk, _ in batches)
        assert sum(256 - padded for _, padded in batches) == real
        assert np.array_equal(_ids(batches), order.at(np.arange(first, first + real)))
    ids = np.concatenate([_ids(batches) for batches in plans.values()])
    assert ids.min() >= 0 and ids.max() < BILLION.total
    assert len(np.unique(ids)) == len(ids)


def test_a_reshard_of_a_billion_samples_takes_the_old_shards_remaining_samples_in_order() -> None:
    old_ranks, new_ranks = RANKS, RANKS // 2
    old, new = old_ranks * WORKERS, new_ranks * WORKERS
    rng = np.random.default_rng(5)
    shapes = [_billion_shard(index) for index in range(old)]
    received = np.array([rng.integers(0, steps + 1) for _first, _real, steps in shapes])
    segment = ((old_ranks, tuple(received.tolist())),)
    real = np.array([r for _first, r, _steps in shapes])
    left = real - np.minimum(received * 256, real)
    starts = np.concatenate([[0], np.cumsum(left)])
    total_left = int(left.sum())
    seen: list[np.ndarray[Any, Any]] = []
    for index in [0, 1, 7, 12_345, new - 2, new - 1]:
        mine = _ids(shard_batches(BILLION, 0, index, new, Position(0, segment), ranks=new_ranks))
        seen.append(mine)
        # where this new shard's samples lie in the sequence of what was left (the rule again)
        rank, worker = divmod(index, WORKERS)
        base, extra = divmod(total_left, new_ranks)
        rank_first, share = rank * base + min(rank, extra), base + (rank < extra)
        steps = -(-total_left // (new_ranks * 256))
        each, more = divmod(steps, WORKERS)
        first_step = worker * each + max(worker - (WORKERS - more), 0)
        first = rank_first + min(first_step * 256, share)
        last = rank_first + min((first_step + each + (worker >= WORKERS - more)) * 256, share)
        # the old shards whose remaining samples make up this new shard, continued on their layout
        owners = range(int(np.searchsorted(starts, first, "right")) - 1, old)
        expected = [np.empty(0, np.int64)]
        for owner in owners:
            if starts[owner] >= last:
                break
            continued = Position(0, segment, continues=True)
            rest = _ids(shard_batches(BILLION, 0, owner, old, continued, ranks=old_ranks))
            expected.append(rest[max(0, first - starts[owner]) : last - starts[owner]])
        assert np.array_equal(mine, np.concatenate(expected)), index
    ids = np.concatenate(seen)
    assert len(np.unique(ids)) == len(ids) and ids.max() < BILLION.total


def test_chained_reshards_of_a_billion_samples_stay_disjoint() -> None:
    rng = np.random.default_rng(8)
    segments: tuple[tuple[int, tuple[int, ...]], ...] = ()
    consumed: list[np.ndarray[Any, Any]] = []
    for ranks, workers in [(8_192, 8), (4_096, 8), (250, 4)]:
        count = ranks * workers
        position = Position(0, segments) if segments else None
        steps = len(shard_batches(BILLION, 0, 0, count, position, ranks=ranks))
        received = rng.integers(0, steps, count)  # (a shard may have one batch fewer)
        for index in [0, count // 2, count - 1]:
            batches = shard_batches(BILLION, 0, index, count, position, ranks=ranks)
            consumed.append(_ids(batches[: received[index]]))
        segments = (*segments, (ranks, tuple(received.tolist())))
    final = Position(0, segments)
    for index in [0, 3, 999]:
        consumed.append(_ids(shard_batches(BILLION, 0, index, 1_000, final, ranks=1_000)))
    ids = np.concatenate(consumed)
    assert len(np.unique(ids)) == len(ids) and ids.min() >= 0 and ids.max() < BILLION.total


def test_without_shuffle_the_plan_delivers_the_samples_in_order() -> None:
    sampling = Sampling(10, 3, 1, False, False)
    assert _delivered(plan_epoch(sampling, 0, 2, None)) == list(range(10))
