"""A mixed source's running permutation kept apart across its turns. Runs in the worker.

A source of a mix (:mod:`._mix`) that runs out of samples starts a new permutation (a *turn*).
Its draws in one block of the mixed epoch are consecutive in its stream, and the block's rows are
shuffled together, so a batch holds draws from a window of the stream: where that window spans
a turn's end, a sample at the end of one turn and at the start of the next could land in one
batch, twice. :class:`SeparatedOrder` keeps the first ``keep`` positions of a turn clear of the
samples at the previous turn's last ``keep``: the base permutation with a few swaps (each
clashing sample of the head swapped with the first free one after it), computed from the two
turns alone, so every worker, rank and resume finds the same order.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .plan import Order

__all__ = ["SeparatedOrder", "reach"]


def reach(plan: Any, source: int, total: int, turn: int, batch_size: int) -> tuple[int, int]:
    """Where turn ``turn`` of ``source`` (of ``total`` samples) starts in its stream: how many
    draws before that start and after it one batch can hold together (all of the source's draws
    in the blocks a batch spans: two, more where a batch is larger than a block); (0, 0) where
    the turn starts with an epoch (no batch holds draws of two epochs). ``plan``: the mix's
    :class:`~._mix.MixPlan`."""
    per_epoch = int(plan.counts[source])
    draw = (turn * total) % per_epoch
    if turn == 0 or draw == 0:
        return 0, 0
    blocks = int(plan.blocks)
    spans = -(-batch_size // max(1, plan.total // blocks)) + 1
    starts = plan.starts(np.arange(blocks + 1, dtype=np.int64))[:, source]
    block = int(np.searchsorted(starts, draw, side="right")) - 1
    first = int(starts[max(block - spans + 1, 0)])
    last = int(starts[min(block + spans, blocks)])
    return draw - first, last - draw


class SeparatedOrder:
    """``base`` (a turn's permutation of ``total`` samples) with its first ``after`` positions
    holding none of the samples at the last ``before`` positions of ``previous`` (the turn
    before: :func:`reach` says how far a batch reaches on either side of the turns' boundary).
    The clashing samples are swapped with the first free ones after the head and before the last
    ``kept`` positions (the reach of the boundary after this turn, left as they are). Where too
    few are free (a source drawn more in one batch's reach than it holds) some clashes stay."""

    __slots__ = ("_base", "_keys", "_values")

    def __init__(
        self, base: Order, previous: Order, total: int, before: int, after: int, kept: int
    ) -> None:
        self._base = base
        self._keys = self._values = np.zeros(0, np.int64)
        if before < 1 or after < 1 or before + after >= total:
            return
        tail = previous.at(np.arange(total - before, total, dtype=np.int64))
        clash = np.flatnonzero(np.isin(base.at(np.arange(after, dtype=np.int64)), tail))
        partners: list[int] = []
        start, end = after, total - kept
        while len(partners) < clash.size and start < end:
            stop = min(end, start + max(4 * int(clash.size), 256))
            found = base.at(np.arange(start, stop, dtype=np.int64))
            free = np.flatnonzero(~np.isin(found, tail)) + start
            partners.extend(free[: clash.size - len(partners)].tolist())
            start = stop
        if not partners:
            return
        clash = clash[: len(partners)]
        keys = np.concatenate([clash, np.asarray(partners, np.int64)])
        values = np.concatenate([np.asarray(partners, np.int64), clash])
        order = np.argsort(keys)
        self._keys, self._values = keys[order], values[order]

    def at(self, positions: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        positions = np.asarray(positions, dtype=np.int64)
        if self._keys.size and positions.size:
            where = np.minimum(np.searchsorted(self._keys, positions), self._keys.size - 1)
            hit = self._keys[where] == positions
            if hit.any():
                positions = positions.copy()
                positions[hit] = self._values[where[hit]]
        return self._base.at(positions)
