"""Positions inside an epoch, and the batches a shard still owes from one. Runs in both processes.

Pure arithmetic, no DALI and no I/O. An epoch of ``total`` samples is one seeded order
(:class:`~workers._epoch_order.EpochOrder`: the sample at each position, computed per
position); a *layout* of ``S`` shards splits it into equal contiguous parts
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

Nothing here is O(samples) but a shard's own batches. What a layout splits is a sequence of
positions of the epoch's order kept as :class:`Runs` (one range per shard that left samples), so
following a position through its segments costs O(shards of each segment); the sample ids of a
shard's batches are then computed for that shard's positions alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from ipc.wire import Position, Sampling

from ._epoch_order import EpochOrder


class Order(Protocol):
    """An epoch's order: the sample id at each position (a bijection of the positions onto the
    dataset's ids, computed per position). :class:`~workers._epoch_order.EpochOrder` is the
    default; a source whose storage wants another (tar shards read a few at a time, a mixture's
    draws from its sources) gives its own."""

    def at(self, positions: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]: ...


#: Makes the order of an epoch: ``orders(epoch)``.
Orders = Callable[[int], Order]

#: One batch: its sample ids (always ``batch_size`` of them) and how many trailing rows are padding.
Batch = tuple[np.ndarray[Any, Any], int]

_Int64s = np.ndarray[Any, np.dtype[np.int64]]


def samples_per_shard(total: int, count: int, drop_last: bool) -> int:
    return total // count if drop_last else math.ceil(total / count)


def steps_per_epoch(total: int, count: int, batch_size: int, drop_last: bool) -> int:
    """Batches every shard yields per epoch."""
    per_shard = samples_per_shard(total, count, drop_last)
    return per_shard // batch_size if drop_last else math.ceil(per_shard / batch_size)


class Runs:
    """A sequence of positions of an epoch's order, as ranges ``[start, start + length)`` in
    sequence order (int64 arrays; adjacent ranges that continue each other are merged). Item ``i``
    of the sequence is found through ``offsets``, the cumulative lengths: slicing costs O(ranges),
    never O(positions)."""

    __slots__ = ("lengths", "offsets", "starts")

    def __init__(self, starts: _Int64s, lengths: _Int64s) -> None:
        kept = lengths > 0
        starts, lengths = starts[kept], lengths[kept]
        if len(starts) > 1:
            heads = np.flatnonzero(np.r_[True, starts[1:] != starts[:-1] + lengths[:-1]])
            starts, lengths = starts[heads], np.add.reduceat(lengths, heads)
        self.starts, self.lengths = starts, lengths
        self.offsets: _Int64s = np.concatenate([np.zeros(1, np.int64), np.cumsum(lengths)])

    @classmethod
    def whole(cls, total: int) -> Runs:
        """Every position of an epoch of ``total`` samples, in order."""
        return cls(np.array([0], np.int64), np.array([total], np.int64))

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def select(self, firsts: _Int64s, lasts: _Int64s) -> Runs:
        """Items ``[firsts[j], lasts[j])`` for every ``j``, in that order (ranges sorted, disjoint,
        inside the sequence)."""
        nonempty = lasts > firsts
        firsts, lasts = firsts[nonempty], lasts[nonempty]
        assert not len(firsts) or (firsts[0] >= 0 and lasts[-1] <= len(self))
        offsets = self.offsets
        first_run = np.searchsorted(offsets, firsts, side="right") - 1
        pieces = np.searchsorted(offsets, lasts, side="left") - first_run
        owner = np.repeat(np.arange(len(firsts)), pieces)
        piece = np.arange(int(pieces.sum())) - np.repeat(np.cumsum(pieces) - pieces, pieces)
        run = first_run[owner] + piece
        low = np.maximum(firsts[owner], offsets[run])
        high = np.minimum(lasts[owner], offsets[run + 1])
        return Runs(self.starts[run] + (low - offsets[run]), high - low)

    def positions(self, first: int, last: int) -> _Int64s:
        """The positions of items ``[first, last)``."""
        part = self.select(np.array([first], np.int64), np.array([max(first, last)], np.int64))
        shift = np.repeat(part.starts - part.offsets[:-1], part.lengths)
        return np.arange(len(part), dtype=np.int64) + shift


class Layout:
    """``count`` shards over the sequence ``runs``: shard ``k`` takes its items
    ``[k * per_shard, (k + 1) * per_shard)`` (fewer at the end: the rest of its ``per_shard`` are
    padding, repeats of the sequence's first items), cut into ``steps`` batches; the last partial
    batch is dropped (``drop_last``) or filled with repeats of its final sample (flagged)."""

    __slots__ = ("batch_size", "count", "drop_last", "per_shard", "runs", "steps")

    def __init__(self, runs: Runs, count: int, batch_size: int, drop_last: bool) -> None:
        self.runs, self.count, self.batch_size, self.drop_last = runs, count, batch_size, drop_last
        self.per_shard = samples_per_shard(len(runs), count, drop_last)
        self.steps = steps_per_epoch(len(runs), count, batch_size, drop_last)
        if drop_last and self.per_shard == 0:
            raise ValueError(
                f"{len(runs)} samples cannot give every one of {count} shards a sample with "
                "drop_last=True; use fewer workers or ranks, or drop_last=False"
            )

    def real(self, index: int) -> tuple[int, int]:
        """Shard ``index``'s items of the sequence (its real samples): ``[first, last)``."""
        if not 0 <= index < self.count:
            raise ValueError(f"shard {index} is not in [0, {self.count})")
        first = min(index * self.per_shard, len(self.runs))
        return first, min(first + self.per_shard, len(self.runs))

    def remaining(self, received: Sequence[int]) -> Runs:
        """The real samples of every shard's batches after its ``received`` ones, in shard order."""
        assert len(received) == self.count
        size, step_rows = len(self.runs), self.steps * self.batch_size
        firsts = np.minimum(np.arange(self.count, dtype=np.int64) * self.per_shard, size)
        ends = np.minimum(np.minimum(firsts + self.per_shard, size), firsts + step_rows)
        done = np.minimum(np.asarray(received, dtype=np.int64), self.steps) * self.batch_size
        return self.runs.select(np.minimum(firsts + done, ends), ends)

    def samples(self, order: Order, index: int, first: int, last: int) -> _Int64s:
        """Items ``[first, last)`` of shard ``index``'s ``per_shard`` (real, then padding)."""
        real_first, real_last = self.real(index)
        real = real_last - real_first
        assert 0 <= first <= last <= self.per_shard and self.per_shard - real <= len(self.runs)
        positions = np.concatenate(
            [
                self.runs.positions(real_first + min(first, real), real_first + min(last, real)),
                self.runs.positions(max(first, real) - real, max(last, real) - real),
            ]
        )
        return order.at(positions)

    def batches(self, order: Order, index: int, delivered: Sequence[int]) -> list[Batch]:
        """Shard ``index``'s batches after the ``delivered[index]`` it has delivered."""
        real_first, real_last = self.real(index)
        size, steps, done = self.batch_size, self.steps, delivered[index]
        if done >= steps:
            return []
        last = steps * size if self.drop_last else self.per_shard
        ids = self.samples(order, index, done * size, last)
        rows = np.concatenate([ids, np.repeat(ids[-1:], (steps - done) * size - len(ids))])
        real_rows = (real_last - real_first) - size * np.arange(done, steps)
        padded = size - np.clip(real_rows, 0, size)
        return list(zip(rows.reshape(steps - done, size), padded.tolist(), strict=True))


def shard_indices(
    total: int,
    shard_index: int,
    shard_count: int,
    *,
    epoch: int,
    seed: int,
    shuffle: bool,
    drop_last: bool,
) -> tuple[np.ndarray[Any, Any], int]:
    """This shard's sample indices for ``epoch``, and how many of them (at the end) are padding."""
    order = EpochOrder(total, epoch, seed, shuffle)
    layout = Layout(Runs.whole(total), shard_count, 1, drop_last)  # (batches play no part)
    first, last = layout.real(shard_index)
    indices = layout.samples(order, shard_index, 0, layout.per_shard)
    return indices, layout.per_shard - (last - first)


def _final_layout(
    sampling: Sampling, epoch: int, count: int, position: Position | None
) -> tuple[Layout, Sequence[int]]:
    """The layout ``count`` shards run ``epoch`` in from ``position``, and how many of each
    shard's batches they have already delivered."""
    if sampling.total < 1:
        raise ValueError("the dataset is empty")
    whole = Runs.whole(sampling.total)
    if position is None or position.epoch != epoch or not position.segments:
        return Layout(whole, count, sampling.batch_size, sampling.drop_last), (0,) * count
    segments = position.segments
    layout = Layout(whole, segments[0][0], sampling.batch_size, sampling.drop_last)
    for k, (segment_count, received) in enumerate(segments):
        last = k == len(segments) - 1
        if last and position.continues:
            if segment_count != count:
                raise ValueError(
                    f"the position continues a layout of {segment_count} shards, not {count}"
                )
            return layout, received
        next_count = count if last else segments[k + 1][0]
        layout = Layout(layout.remaining(received), next_count, sampling.batch_size, False)
    return layout, (0,) * count


def _order(sampling: Sampling, epoch: int, orders: Orders | None) -> Order:
    if orders is None:
        return EpochOrder(sampling.total, epoch, sampling.seed, sampling.shuffle)
    return orders(epoch)


def plan_epoch(
    sampling: Sampling,
    epoch: int,
    count: int,
    position: Position | None,
    orders: Orders | None = None,
) -> list[list[Batch]]:
    """Every shard's batches of ``epoch`` on a layout of ``count`` shards, from ``position``
    (a fresh epoch when it is None or about another epoch). ``orders``: the source's own epoch
    orders, if it has them (else the seeded :class:`EpochOrder` of ``sampling``)."""
    layout, delivered = _final_layout(sampling, epoch, count, position)
    order = _order(sampling, epoch, orders)
    return [layout.batches(order, index, delivered) for index in range(count)]


def shard_batches(
    sampling: Sampling,
    epoch: int,
    index: int,
    count: int,
    position: Position | None,
    orders: Orders | None = None,
) -> list[Batch]:
    """Shard ``index`` of ``count``: its batches of ``epoch`` from ``position`` on. Costs
    O(shards of the position's segments + this shard's samples)."""
    layout, delivered = _final_layout(sampling, epoch, count, position)
    order = _order(sampling, epoch, orders)
    return layout.batches(order, index, delivered)


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
