"""Padding only where the fixed batch size forces it, through real workers: a rank's batches are
shared out whole among its workers, so only each rank's last batch is padded, whatever the
number of workers (80 samples in batches of 16: 5 batches on one rank, with 2, 3 or 4 workers)."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from loader import Loader, shard_steps
from tests import pipelines as P


def _loader(workers: int, rank: int = 0, world: int = 1) -> Loader:
    source = functools.partial(P.sample_source, total=80, batch_size=16)
    return Loader(
        source,
        P.cast_step,
        batch_size=16,
        num_workers=workers,
        rank=rank,
        world_size=world,
        copy=True,
    )


def _epoch(loader: Loader) -> list[tuple[list[int], int, int]]:
    """Per batch: its real ids, its padded rows and the worker that made it."""
    out = []
    for batch in loader:
        ids = [int(v) for v in batch["id"].ravel()]
        out.append((ids[: len(ids) - batch.info.padded], batch.info.padded, batch.info.worker))
    return out


@pytest.mark.parametrize("workers", [2, 3, 4])
def test_one_rank_gets_5_batches_without_a_padded_row_on_any_number_of_workers(
    workers: int,
) -> None:
    with _loader(workers) as loader:
        assert len(loader) == 5
        for _ in range(2):  # every epoch, not only the first
            batches = _epoch(loader)
            assert len(batches) == 5 and all(padded == 0 for _, padded, _ in batches)
            assert sorted(i for ids, _, _ in batches for i in ids) == list(range(80))
        # round robin over workers that still have batches: the last ones have one more
        steps = [shard_steps(80, w, workers, 16, False) for w in range(workers)]
        rounds = [w for turn in range(max(steps)) for w in range(workers) if steps[w] > turn]
        assert [w for _, _, w in batches] == rounds


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_two_ranks_pad_at_most_one_batch_each(workers: int) -> None:
    seen: list[int] = []
    lengths, padded = [], 0
    for rank in range(2):
        with _loader(workers, rank, 2) as loader:
            batches = _epoch(loader)
            lengths.append((len(loader), len(batches)))
            padded += sum(p for _, p, _ in batches)
            assert len([p for _, p, _ in batches if p]) <= 1
            assert all(p == 0 for _, p, _ in batches[:-1])  # the short one ends the epoch
            seen += [i for ids, _, _ in batches for i in ids]
    assert lengths[0] == lengths[1] == (3, 3)  # equal steps per rank: DDP never waits
    assert padded == 2 * 3 * 16 - 80 <= 31
    assert sorted(seen) == list(range(80))


def test_an_epoch_resumed_on_uneven_workers_continues_exactly() -> None:
    """3 workers share 5 batches 1, 2, 2: a state taken after 3 batches resumes the same
    bytes on the same layout, and the samples exactly once on another."""

    def take(loader: Loader, count: int) -> tuple[list[Any], dict[str, Any]]:
        iterator = iter(loader)
        got = [next(iterator)["id"].ravel().tolist() for _ in range(count)]
        return got, loader.state_dict()

    with _loader(3) as loader:
        whole = [b["id"].ravel().tolist() for b in loader]
    with _loader(3) as loader:
        before, state = take(loader, 3)
    with _loader(3) as loader:
        loader.load_state_dict(state)
        assert (len(loader), loader.remaining()) == (5, 2)
        after = [b["id"].ravel().tolist() for b in loader]
    assert before + after == whole
    with _loader(2) as loader:
        loader.load_state_dict(state)
        rest = [i for ids, _, _ in _epoch(loader) for i in ids]
    assert sorted([i for ids in before for i in ids] + rest) == list(range(80))
