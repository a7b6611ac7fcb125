"""Positions inside an epoch, and the batches a shard still owes from one. Runs in both processes.

Pure arithmetic, no DALI and no I/O. An epoch of ``total`` samples is one seeded permutation
(:func:`epoch_permutation`); a *layout* of ``S`` shards splits it into equal contiguous parts
(:func:`shard_indices`), each cut into batches of ``batch_size``. A *position* says how far the
trainer got: per shard, how many of its batches it has received. Because every order is computed
from the seed and the epoch alone, a position is a few integers and any shard can start at any
batch without reading the ones before it.

A position is a list of *segments*, oldest first: ``(S, received)`` -- the layout a run used and
how many batches each of its shards delivered. A run resumed on the same layout continues each
shard's own batches (the stream equals the uninterrupted one); a run resumed on another layout
(another world size or worker count) takes the samples not yet received -- every old shard's
remaining real samples, in shard order -- and splits them into equal contiguous parts for the new
shards, padding short ones with repeats that are flagged. Such a split never drops a sample, even
with ``drop_last=True``: what the interrupted epoch would still have delivered is delivered once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ipc.wire import Position, Sampling

#: One batch: its sample ids (always ``batch_size`` of them) and how many trailing rows are padding.
Batch = tuple[np.ndarray[Any, Any], int]


def epoch_permutation(total: int, epoch: int, seed: int, shuffle: bool) -> np.ndarray[Any, Any]:
    """The global order of ``total`` samples in ``epoch``: the same on every rank and worker."""
    if not shuffle:
        return np.arange(total)
    return np.random.default_rng([seed, epoch]).permutation(total)


def samples_per_shard(total: int, count: int, drop_last: bool) -> int:
    return total // count if drop_last else math.ceil(total / count)


def steps_per_epoch(total: int, count: int, batch_size: int, drop_last: bool) -> int:
    """Batches every shard yields per epoch."""
    per_shard = samples_per_shard(total, count, drop_last)
    return per_shard // batch_size if drop_last else math.ceil(per_shard / batch_size)


def shard_indices(
    total: int,
    shard_index: int,
    shard_count: int,
    *,
    epoch: int,
    seed: int,
    shuffle: bool,
    drop_last: bool,
    order: np.ndarray[Any, Any] | None = None,
) -> tuple[np.ndarray[Any, Any], int]:
    """This shard's sample indices for ``epoch``, and how many of them (at the end) are padding.

    ``order``: the epoch's permutation, when the caller already has it."""
    if total < 1:
        raise ValueError("the dataset is empty")
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"shard {shard_index} is not in [0, {shard_count})")
    if order is None:
        order = epoch_permutation(total, epoch, seed, shuffle)
    per_shard = samples_per_shard(total, shard_count, drop_last)
    if per_shard == 0:
        raise ValueError(
            f"{total} samples cannot give every one of {shard_count} shards a sample with "
            "drop_last=True; use fewer workers or ranks, or drop_last=False"
        )
    start = shard_index * per_shard
    mine = order[start : start + per_shard]
    padded = per_shard - len(mine)
    if padded:
        mine = np.concatenate([mine, order[np.arange(padded) % total]])
    return mine, padded


def batches_of(
    indices: np.ndarray[Any, Any], padded_tail: int, batch_size: int, drop_last: bool
) -> list[Batch]:
    """Full batches over a shard's ``indices`` whose last ``padded_tail`` are padding; the last
    partial batch is dropped, or filled with repeats of its final sample (flagged)."""
    real = len(indices) - padded_tail
    batches: list[Batch] = []
    for start in range(0, len(indices), batch_size):
        chunk = indices[start : start + batch_size]
        if len(chunk) < batch_size:
            if drop_last:
                break
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], batch_size - len(chunk))])
        batches.append((chunk, batch_size - max(0, min(batch_size, real - start))))
    return batches


def layout_batches(
    sampling: Sampling, epoch: int, count: int, only: int | None = None
) -> list[list[Batch]]:
    """Every shard's batches of ``epoch`` under a fresh layout of ``count`` shards (only shard
    ``only``'s list is filled in when given; the others are empty)."""
    order = epoch_permutation(sampling.total, epoch, sampling.seed, sampling.shuffle)
    lists: list[list[Batch]] = []
    for index in range(count):
        if only is not None and index != only:
            lists.append([])
            continue
        indices, padded = shard_indices(
            sampling.total,
            index,
            count,
            epoch=epoch,
            seed=sampling.seed,
            shuffle=sampling.shuffle,
            drop_last=sampling.drop_last,
            order=order,
        )
        lists.append(batches_of(indices, padded, sampling.batch_size, sampling.drop_last))
    return lists


def remaining_samples(
    lists: Sequence[Sequence[Batch]], received: Sequence[int]
) -> np.ndarray[Any, Any]:
    """The real samples of every shard's batches after its ``received`` ones, in shard order."""
    parts = [
        chunk[: len(chunk) - padded]
        for batches, done in zip(lists, received, strict=True)
        for chunk, padded in batches[done:]
    ]
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


def split_batches(samples: np.ndarray[Any, Any], count: int, batch_size: int) -> list[list[Batch]]:
    """``samples`` in ``count`` equal contiguous parts, short ones padded with repeats (flagged)."""
    per_shard = math.ceil(len(samples) / count)
    lists = []
    for index in range(count):
        mine = samples[index * per_shard : (index + 1) * per_shard]
        padded = per_shard - len(mine)
        if padded:
            mine = np.concatenate([mine, samples[np.arange(padded) % len(samples)]])
        lists.append(batches_of(mine, padded, batch_size, drop_last=False))
    return lists


def plan_epoch(
    sampling: Sampling, epoch: int, count: int, position: Position | None
) -> list[list[Batch]]:
    """Every shard's batches of ``epoch`` on a layout of ``count`` shards, from ``position``
    (a fresh epoch when it is None or about another epoch)."""
    if position is None or position.epoch != epoch or not position.segments:
        return layout_batches(sampling, epoch, count)
    segments = position.segments
    lists = layout_batches(sampling, epoch, segments[0][0])
    for k, (segment_count, received) in enumerate(segments):
        if len(lists) != segment_count:
            raise ValueError(
                f"position segment {k} has {segment_count} shards but the plan has {len(lists)}"
            )
        last = k == len(segments) - 1
        if last and position.continues:
            if segment_count != count:
                raise ValueError(
                    f"the position continues a layout of {segment_count} shards, not {count}"
                )
            return [batches[done:] for batches, done in zip(lists, received, strict=True)]
        next_count = count if last else segments[k + 1][0]
        lists = split_batches(remaining_samples(lists, received), next_count, sampling.batch_size)
    return lists


def shard_batches(
    sampling: Sampling, epoch: int, index: int, count: int, position: Position | None
) -> list[Batch]:
    """Shard ``index`` of ``count``: its batches of ``epoch`` from ``position`` on."""
    if position is None or position.epoch != epoch or not position.segments:
        return layout_batches(sampling, epoch, count, only=index)[index]
    return plan_epoch(sampling, epoch, count, position)[index]


def continue_from(
    position: Position | None, epoch: int, count: int, index: int, steps: int
) -> Position:
    """Where shard ``index`` of ``count`` goes on in ``epoch`` after ``steps`` more of its
    batches than ``position`` (the position its sources started from; None: the epoch's start).

    Only shard ``index``'s count matters in the result: the position continues each shard.
    """
    if position is None or position.epoch != epoch or not position.segments:
        received = [0] * count
        received[index] = steps
        return Position(epoch, ((count, tuple(received)),), continues=True)
    if position.continues:
        *head, (last_count, last) = position.segments
        advanced = list(last)
        advanced[index] += steps
        return Position(epoch, (*head, (last_count, tuple(advanced))), continues=True)
    received = [0] * count
    received[index] = steps
    return Position(epoch, (*position.segments, (count, tuple(received))), continues=True)
