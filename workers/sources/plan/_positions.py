"""Positions inside an epoch, and the batches a shard still owes from one. Runs in both processes.

Pure arithmetic, no DALI and no I/O. An epoch of ``total`` samples is one seeded order
(:class:`~workers.sources.plan.EpochOrder`: the sample at each position, computed per
position); a *layout* of ``S`` shards on ``R`` ranks (``S / R`` workers each) splits it into
``R`` contiguous parts as equal as they can be, each cut into batches of ``batch_size`` that the
rank's workers share out whole (:class:`Layout`): every rank yields the same number of batches,
a worker may yield one more than another, and only the last batch of a rank is padded. A
*position* says how far the trainer got: per shard, how many of its batches it has received.
Because every order is computed from the seed and the epoch alone, a position is a few integers
and any shard can start at any batch without reading the ones before it.

A position is a list of *segments*, oldest first: ``(R, received)`` -- the layout a run used
(its ranks, and one count per shard) and how many batches each of its shards delivered. A run
resumed on the same layout continues each shard's own batches (the stream equals the
uninterrupted one); a run resumed on another layout (another world size or worker count) takes
the samples not yet received -- every old shard's remaining real samples, in shard order -- and
splits them the same way among the new ranks and shards, padding the last batch of each rank
with repeats that are flagged. Such a split never drops a sample, even with ``drop_last=True``:
what the interrupted epoch would still have delivered is delivered once.

Nothing here is O(samples) but a shard's own batches. What a layout splits is a sequence of
positions of the epoch's order kept as :class:`Runs` (one range per shard that left samples), so
following a position through its segments costs O(shards of each segment); the sample ids of a
shard's batches are then computed for that shard's positions alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from ipc.wire import Position, Sampling

from ._epoch_order import EpochOrder


class Order(Protocol):
    """An epoch's order: the sample id at each position (a bijection of the positions onto the
    dataset's ids, computed per position). :class:`~workers.sources.plan.EpochOrder` is the
    default; a source whose storage wants another (tar shards read a few at a time, a mixture's
    draws from its sources) gives its own."""

    def at(self, positions: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]: ...


class Orders(Protocol):
    """Makes the order of an epoch: ``orders(epoch, parts)``. ``parts``: where each shard's part
    of the epoch starts and ends (sorted positions, from 0 to the epoch's size) in the layout the
    epoch started with; an order may keep what a part reads together (tar shards: each shard read
    by one worker), and must give the same order for the same ``parts`` all epoch long, through
    resumes on other layouts."""

    def __call__(self, epoch: int, parts: np.ndarray[Any, Any] | None = None) -> Order: ...


#: One batch: its sample ids (always ``batch_size`` of them) and how many trailing rows are padding.
Batch = tuple[np.ndarray[Any, Any], int]

_Int64s = np.ndarray[Any, np.dtype[np.int64]]


def steps_per_epoch(
    total: int, count: int, batch_size: int, drop_last: bool, ranks: int = 1
) -> int:
    """Batches every rank yields per epoch when ``count`` shards (``count // ranks`` workers on
    each of ``ranks`` ranks) split an epoch of ``total`` samples. A worker yields
    :func:`shard_steps` of them: the rank's batches shared out whole, the last workers one more."""
    return Layout(Runs.whole(total), count, batch_size, drop_last, ranks=ranks).rank_steps


def shard_steps(
    total: int, index: int, count: int, batch_size: int, drop_last: bool, ranks: int = 1
) -> int:
    """Batches shard ``index`` of ``count`` (on ``ranks`` ranks) yields in a whole epoch."""
    return Layout(Runs.whole(total), count, batch_size, drop_last, ranks=ranks).steps(index)


def every_shard_steps(
    total: int, count: int, batch_size: int, drop_last: bool, ranks: int = 1
) -> list[int]:
    """:func:`shard_steps` of every shard, in one O(shards) pass."""
    layout = Layout(Runs.whole(total), count, batch_size, drop_last, ranks=ranks)
    return layout.bounds(np.arange(count, dtype=np.int64))[4].tolist()  # type: ignore[no-any-return]


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
    """``count`` shards over the sequence ``runs``, ``count // ranks`` consecutive shards (the
    workers) on each of ``ranks`` ranks.

    The sequence is split into ``ranks`` contiguous parts as equal as they can be (with
    ``drop_last``: ``rank_steps`` full batches each, the rest of the sequence left out). Every rank
    yields ``rank_steps`` batches, the fewest that hold its part; its batches are shared out whole
    among its workers, in order (worker ``w`` takes the next ``rank_steps // W`` of them, one more
    when ``w >= W - rank_steps % W``: the last workers take the extra ones), so only a rank's last
    batch can be short: its missing rows are padding (repeats of the shard's last sample,
    flagged), at most ``ranks * batch_size - 1`` rows in an epoch. The short batch is the last
    one of the last worker, which round robin also delivers last: it ends the rank's epoch.
    When a rank has fewer batches than workers, each of its workers yields one batch (the rest
    padding): a worker always has a batch to trace.
    """

    __slots__ = ("batch_size", "count", "drop_last", "rank_steps", "ranks", "runs", "workers")

    def __init__(
        self, runs: Runs, count: int, batch_size: int, drop_last: bool, *, ranks: int
    ) -> None:
        if ranks < 1 or count < 1 or count % ranks:
            raise ValueError(f"{count} shards cannot be split evenly among {ranks} ranks")
        self.runs, self.count, self.batch_size, self.drop_last = runs, count, batch_size, drop_last
        self.ranks, self.workers = ranks, count // ranks
        size, rows = len(runs), ranks * batch_size
        steps = size // rows if drop_last else -(-size // rows)
        if drop_last and steps < self.workers:
            raise ValueError(
                f"{size} samples in batches of {batch_size} give each of {ranks} rank(s) "
                f"{steps} full batch(es) with drop_last=True, fewer than its {self.workers} "
                f"workers; use at most {max(steps, 1)} workers, fewer ranks, a smaller batch "
                "or drop_last=False"
            )
        #: batches every rank yields
        self.rank_steps = max(steps, self.workers) if steps else 0

    def bounds(self, index: _Int64s) -> tuple[_Int64s, _Int64s, _Int64s, _Int64s, _Int64s]:
        """Per shard in ``index``: its rank's first item of the sequence, the rank's number of
        items, the shard's real items ``[first, last)`` counted from the rank's first, and its
        batches."""
        rank, worker = np.divmod(index, self.workers)
        size, batch = len(self.runs), self.batch_size
        if self.drop_last:
            share = np.full_like(rank, self.rank_steps * batch)
            rank_first = rank * share
        else:
            base, extra = divmod(size, self.ranks)
            rank_first = rank * base + np.minimum(rank, extra)
            share = base + (rank < extra).astype(np.int64)
        each, more = divmod(self.rank_steps, self.workers)
        fewer = self.workers - more  # the first workers, with ``each`` batches
        steps = each + (worker >= fewer).astype(np.int64)
        first_step = worker * each + np.maximum(worker - fewer, 0)
        first = np.minimum(first_step * batch, share)
        last = np.minimum((first_step + steps) * batch, share)
        return rank_first, share, first, last, steps

    def _one(self, index: int) -> tuple[int, int, int, int, int]:
        if not 0 <= index < self.count:
            raise ValueError(f"shard {index} is not in [0, {self.count})")
        rank_first, share, first, last, steps = self.bounds(np.array([index], np.int64))
        return (
            int(rank_first[0]),
            int(share[0]),
            int(first[0]),
            int(last[0]),
            int(steps[0]),
        )

    def steps(self, index: int) -> int:
        """Batches shard ``index`` yields."""
        return self._one(index)[4]

    def parts(self) -> _Int64s:
        """Where each shard's real items start and end in the sequence (sorted, with 0 and its
        length): the ``parts`` an :class:`Orders` is given, for the layout an epoch starts with."""
        rank_first, _share, first, last, _steps = self.bounds(np.arange(self.count, dtype=np.int64))
        edges = [np.array([0, len(self.runs)], np.int64), rank_first + first, rank_first + last]
        parts: _Int64s = np.unique(np.concatenate(edges))
        return parts

    def remaining(self, received: Sequence[int]) -> Runs:
        """The real samples of every shard's batches after its ``received`` ones, in shard order."""
        assert len(received) == self.count
        rank_first, _share, first, last, steps = self.bounds(np.arange(self.count, dtype=np.int64))
        done = np.minimum(np.asarray(received, dtype=np.int64), steps) * self.batch_size
        return self.runs.select(rank_first + np.minimum(first + done, last), rank_first + last)

    def rows(self, order: Order, index: int, done: int) -> tuple[_Int64s, int, int]:
        """Shard ``index``'s rows after its first ``done`` batches (real samples, then
        padding), its real samples in all and its batches."""
        rank_first, share, first, last, steps = self._one(index)
        if done >= steps:
            return np.empty(0, np.int64), last - first, steps
        start = min(first + done * self.batch_size, last)
        ids = order.at(self.runs.positions(rank_first + start, rank_first + last))
        missing = (steps - done) * self.batch_size - len(ids)
        if missing:
            # a repeat of the shard's last sample, else of its rank's first, else the first one
            filler = rank_first + (last - 1 if last > first else 0) if share else 0
            repeat = order.at(self.runs.positions(filler, filler + 1))
            ids = np.concatenate([ids, np.repeat(repeat, missing)])
        return ids, last - first, steps

    def batches(self, order: Order, index: int, delivered: Sequence[int]) -> list[Batch]:
        """Shard ``index``'s batches after the ``delivered[index]`` it has delivered."""
        ids, real, steps = self.rows(order, index, delivered[index] if index < self.count else 0)
        done, size = delivered[index], self.batch_size
        if done >= steps:
            return []
        real_rows = real - size * np.arange(done, steps)
        padded = size - np.clip(real_rows, 0, size)
        return list(zip(ids.reshape(steps - done, size), padded.tolist(), strict=True))


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
    """This shard's sample indices for ``epoch``, and how many of them (at the end) are padding.
    Every shard gets the same number of indices (as a rank would): the shards' parts differ by
    at most one sample, so a shard pads at most one."""
    order = EpochOrder(total, epoch, seed, shuffle)
    layout = Layout(Runs.whole(total), shard_count, 1, drop_last, ranks=shard_count)
    indices, real, _steps = layout.rows(order, shard_index, 0)
    return indices, len(indices) - real


def _final_layout(
    sampling: Sampling, epoch: int, count: int, ranks: int, position: Position | None
) -> tuple[Layout, Sequence[int], Layout]:
    """The layout ``count`` shards on ``ranks`` ranks run ``epoch`` in from ``position``, how
    many of each shard's batches they have already delivered, and the layout the epoch started
    with (whose parts decide a source's own order)."""
    if sampling.total < 1:
        raise ValueError("the dataset is empty")
    whole = Runs.whole(sampling.total)
    size, drop_last = sampling.batch_size, sampling.drop_last
    if position is None or position.epoch != epoch or not position.segments:
        layout = Layout(whole, count, size, drop_last, ranks=ranks)
        return layout, (0,) * count, layout
    segments = position.segments
    first_ranks, first_received = segments[0]
    layout = first = Layout(whole, len(first_received), size, drop_last, ranks=first_ranks)
    for k, (segment_ranks, received) in enumerate(segments):
        last = k == len(segments) - 1
        if last and position.continues:
            if (segment_ranks, len(received)) != (ranks, count):
                raise ValueError(
                    f"the position continues a layout of {len(received)} shards on "
                    f"{segment_ranks} rank(s), not {count} on {ranks}"
                )
            return layout, received, first
        next_ranks, next_count = (
            (ranks, count) if last else (segments[k + 1][0], len(segments[k + 1][1]))
        )
        layout = Layout(layout.remaining(received), next_count, size, False, ranks=next_ranks)
    return layout, (0,) * count, first


def steps_left(
    sampling: Sampling,
    epoch: int,
    indices: Sequence[int],
    count: int,
    position: Position | None,
    *,
    ranks: int = 1,
) -> list[int]:
    """Per shard in ``indices`` (of ``count`` on ``ranks`` ranks), the batches of ``epoch`` it
    still yields from ``position``: what :func:`shard_batches` would give, counted without
    computing a sample (O(shards of the position's segments))."""
    layout, delivered, _first = _final_layout(sampling, epoch, count, ranks, position)
    return [max(0, layout.steps(index) - delivered[index]) for index in indices]


def _order(sampling: Sampling, epoch: int, orders: Orders | None, first: Layout) -> Order:
    if orders is None:
        return EpochOrder(sampling.total, epoch, sampling.seed, sampling.shuffle)
    return orders(epoch, first.parts())


def plan_epoch(
    sampling: Sampling,
    epoch: int,
    count: int,
    position: Position | None,
    orders: Orders | None = None,
    *,
    ranks: int = 1,
) -> list[list[Batch]]:
    """Every shard's batches of ``epoch`` on a layout of ``count`` shards over ``ranks`` ranks,
    from ``position`` (a fresh epoch when it is None or about another epoch). ``orders``: the
    source's own epoch orders, if it has them (else the seeded :class:`EpochOrder` of
    ``sampling``)."""
    layout, delivered, first = _final_layout(sampling, epoch, count, ranks, position)
    order = _order(sampling, epoch, orders, first)
    return [layout.batches(order, index, delivered) for index in range(count)]


def shard_batches(
    sampling: Sampling,
    epoch: int,
    index: int,
    count: int,
    position: Position | None,
    orders: Orders | None = None,
    *,
    ranks: int = 1,
) -> list[Batch]:
    """Shard ``index`` of ``count`` (on ``ranks`` ranks): its batches of ``epoch`` from
    ``position`` on. Costs O(shards of the position's segments + this shard's samples)."""
    layout, delivered, first = _final_layout(sampling, epoch, count, ranks, position)
    order = _order(sampling, epoch, orders, first)
    return layout.batches(order, index, delivered)


def continue_from(
    position: Position | None, epoch: int, count: int, index: int, steps: int, *, ranks: int
) -> Position:
    """Where shard ``index`` of ``count`` (on ``ranks`` ranks) goes on in ``epoch`` after
    ``steps`` more of its batches than ``position`` (the position its sources started from;
    None: the epoch's start).

    Only shard ``index``'s count matters in the result: the position continues each shard.
    """
    if position is None or position.epoch != epoch or not position.segments:
        received = [0] * count
        received[index] = steps
        return Position(epoch, ((ranks, tuple(received)),), continues=True)
    if position.continues:
        *head, (last_ranks, last) = position.segments
        advanced = list(last)
        advanced[index] += steps
        return Position(epoch, (*head, (last_ranks, tuple(advanced))), continues=True)
    received = [0] * count
    received[index] = steps
    return Position(epoch, (*position.segments, (ranks, tuple(received))), continues=True)
