"""An epoch's order of a tar dataset's samples (:class:`TarOrder`) and the orders of the epochs
a worker asks for (:class:`TarOrders`). Runs in the worker.

Sample ids number the samples shard after shard, in tar order. An epoch's order is a permutation
of all of them, determined by the seed and the epoch:

* ``shuffle_window=None`` (local shards): one permutation of the whole dataset (the plan's own
  :class:`~workers.sources.plan.EpochOrder`; this module is not used).
* ``shuffle_window=k`` (remote shards: 4 by default): the shards are permuted and their samples
  concatenated; that sequence is cut where each worker's part of the epoch starts and ends (in
  the layout the epoch started with), each part is cut into groups of ``k`` shards (a shard
  that straddles two parts gives each its own piece), and the samples of each group are
  permuted among themselves. A sample can land anywhere in its group, and the groups come in a
  random order; a sample never meets, in one batch, samples of shards outside its group.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

from ..plan import EpochOrder, orders_at
from ._shards import TarShards

_Int64s = np.ndarray[Any, np.dtype[np.int64]]


class TarOrder:
    """The samples at positions of one epoch (see the module docstring): shards permuted and
    concatenated, that sequence cut into *parts* (``parts``: the sorted positions where each
    worker's part of the epoch starts and ends, in the layout the epoch started with; None: one
    part), each part cut into groups of ``window`` shards (or pieces of shards, at a part's
    edges), and the samples permuted inside each group. A worker whose part is a run of groups
    then reads of each shard one contiguous range that no other worker reads: an epoch reads
    each shard's bytes once, whatever the number of workers and ranks."""

    def __init__(
        self,
        shards: TarShards,
        epoch: int,
        seed: int,
        window: int,
        parts: np.ndarray[Any, Any] | None = None,
    ) -> None:
        count = len(shards.counts)
        self.shards, self.window, self.epoch, self.seed = shards, window, epoch, seed
        self.permuted: _Int64s = EpochOrder(count, epoch, seed, True).at(np.arange(count))
        #: where each permuted shard's samples start in the sequence, and the total
        self.runs: _Int64s = np.concatenate(
            [np.zeros(1, np.int64), np.cumsum(shards.counts[self.permuted])]
        )
        total = int(self.runs[-1])
        given = np.empty(0, np.int64) if parts is None else np.asarray(parts, np.int64)
        cuts = np.unique(np.clip(np.concatenate([given, [0, total]]), 0, total))
        # pieces: the sequence cut at every shard's start and every part's edge
        pieces = np.unique(np.concatenate([self.runs, cuts]))[:-1]
        part = np.searchsorted(cuts, pieces, side="right") - 1
        first_piece = np.searchsorted(pieces, cuts[part])  # the first piece of each piece's part
        heads = (np.arange(len(pieces)) - first_piece) % window == 0
        #: where each group starts in the sequence, and the total
        self.group_starts: _Int64s = np.concatenate([pieces[heads], [total]]).astype(np.int64)
        self._seeds: dict[int, int] = {}

    def at(self, positions: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        positions = np.asarray(positions, dtype=np.int64)
        groups = np.searchsorted(self.group_starts, positions, side="right") - 1
        # every group's samples permuted by its own order, all groups in one vectorised pass
        found, inverse = np.unique(groups, return_inverse=True)
        firsts = self.group_starts[found]
        sizes = self.group_starts[found + 1] - firsts
        seeds = [self._group_seed(group) for group in found.tolist()]
        starts = firsts[inverse]
        sequence = starts + orders_at(sizes, seeds, self.epoch, inverse, positions - starts)
        # a place in the sequence is a sample of a permuted shard, in tar order
        slot = np.searchsorted(self.runs, sequence, side="right") - 1
        ids: np.ndarray[Any, Any] = self.shards.starts[self.permuted[slot]] + (
            sequence - self.runs[slot]
        )
        return ids

    def _group_seed(self, group: int) -> int:
        """The seed of the order inside ``group`` (kept: an epoch's plan is asked for more than
        once)."""
        seed = self._seeds.get(group)
        if seed is None:
            key = np.random.SeedSequence([self.seed, self.epoch, group]).generate_state(1)
            seed = self._seeds[group] = int(key[0])
        return seed


class TarOrders:
    """``orders(epoch, parts)`` for :class:`BatchedSamples`: the :class:`TarOrder` of each epoch
    (the last two are kept: the worker asks for the current and the next one)."""

    def __init__(self, shards: TarShards, seed: int, window: int) -> None:
        self.shards, self.seed, self.window = shards, seed, window
        self._made: OrderedDict[tuple[int, bytes], TarOrder] = OrderedDict()

    def __call__(self, epoch: int, parts: np.ndarray[Any, Any] | None = None) -> TarOrder:
        key = (epoch, b"" if parts is None else np.asarray(parts, np.int64).tobytes())
        order = self._made.get(key)
        if order is None:
            order = TarOrder(self.shards, epoch, self.seed, self.window, parts)
            self._made[key] = order
            while len(self._made) > 2:
                self._made.popitem(last=False)
        return order
