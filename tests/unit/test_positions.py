"""The position arithmetic behind resume and reshard (no processes, no DALI)."""

from __future__ import annotations

import itertools
import random

import pytest

from workers import Position, Sampling, plan_epoch


def _real(batches: list[tuple[object, int]]) -> list[int]:
    ids: list[int] = []
    for chunk, padded in batches:
        values = [int(v) for v in chunk]  # type: ignore[attr-defined]
        ids += values[: len(values) - padded]
    return ids


def _delivered(sampling: Sampling, epoch: int, count: int, position: Position | None) -> list[int]:
    return [i for shard in plan_epoch(sampling, epoch, count, position) for i in _real(shard)]


def _received_at(lists: list[list[tuple[object, int]]], fraction: float) -> tuple[int, ...]:
    """Counts a round-robin trainer has received after ``fraction`` of the epoch's batches."""
    counts = [0] * len(lists)
    target = int(fraction * sum(len(b) for b in lists))
    cursor = 0
    while sum(counts) < target:
        if counts[cursor] < len(lists[cursor]):
            counts[cursor] += 1
        cursor = (cursor + 1) % len(lists)
    return tuple(counts)


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
    for total, batch, old, new, where, drop_last in CASES[chunk::4]:
        if drop_last and total < old:
            continue
        sampling = Sampling(total, batch, 5, True, drop_last)
        before = plan_epoch(sampling, 2, old, None)
        uninterrupted = sorted(i for shard in before for i in _real(shard))
        received = _received_at(before, where)
        consumed = [
            i for shard, done in zip(before, received, strict=True) for i in _real(shard[:done])
        ]
        position = Position(2, ((old, received),), continues=False)
        after = plan_epoch(sampling, 2, new, position)
        assert len({len(shard) for shard in after}) <= 1, "every new shard the same steps"
        resumed = [i for shard in after for i in _real(shard)]
        assert sorted(consumed + resumed) == uninterrupted, (total, batch, old, new, where)
        assert all(len(chunk_) == batch for shard in after for chunk_, _ in shard)


def test_same_layout_continues_each_shard_where_it_stopped() -> None:
    sampling = Sampling(50, 4, 1, True, False)
    before = plan_epoch(sampling, 0, 3, None)
    received = (3, 2, 2)
    after = plan_epoch(sampling, 0, 3, Position(0, ((3, received),), continues=True))
    for shard, done, rest in zip(before, received, after, strict=True):
        assert [list(c) for c, _ in shard[done:]] == [list(c) for c, _ in rest]


def test_chained_resumes_on_changing_layouts_stay_exactly_once() -> None:
    rng = random.Random(3)
    for _ in range(200):
        total, batch = rng.randint(1, 90), rng.randint(1, 6)
        sampling = Sampling(total, batch, 9, rng.random() < 0.5, False)
        layouts = [rng.randint(1, 5) for _ in range(rng.randint(2, 4))]
        segments: list[tuple[int, tuple[int, ...]]] = []
        consumed: list[int] = []
        lists = plan_epoch(sampling, 1, layouts[0], None)
        for k, count in enumerate(layouts):
            if k:
                position = Position(1, tuple(segments), continues=False)
                lists = plan_epoch(sampling, 1, count, position)
                assert len({len(shard) for shard in lists}) <= 1
            received = _received_at(lists, rng.random())
            consumed += [
                i for shard, done in zip(lists, received, strict=True) for i in _real(shard[:done])
            ]
            segments.append((count, received))
        rest = plan_epoch(sampling, 1, 2, Position(1, tuple(segments), continues=False))
        remaining = [i for shard in rest for i in _real(shard)]
        assert sorted(consumed + remaining) == list(range(total))


def test_a_position_of_another_epoch_is_ignored() -> None:
    sampling = Sampling(20, 4, 0, True, False)
    fresh = plan_epoch(sampling, 3, 2, None)
    other = plan_epoch(sampling, 3, 2, Position(2, ((2, (1, 1)),), continues=True))
    assert [[list(c) for c, _ in s] for s in fresh] == [[list(c) for c, _ in s] for s in other]


def test_a_continued_position_must_keep_its_layout() -> None:
    sampling = Sampling(20, 4, 0, True, False)
    with pytest.raises(ValueError, match="continues a layout of 2 shards, not 3"):
        plan_epoch(sampling, 0, 3, Position(0, ((2, (1, 1)),), continues=True))
