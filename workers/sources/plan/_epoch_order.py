"""An epoch's order of samples: a seeded bijection of ``[0, total)``. Runs in both processes.

Position ``p`` of epoch ``e`` holds sample ``EpochOrder(total, e, seed, shuffle).at(p)``. The
bijection is evaluated per position, so whoever needs the samples at some positions computes those
and nothing else: no process ever holds the whole epoch's permutation.

With ``shuffle=False`` the order is the identity. Otherwise it is a Feistel network over the
``m``-bit integers (``2**m`` the smallest power of two >= ``total``, at least 4): a position's
high and low halves (``ceil(m/2)`` and ``floor(m/2)`` bits) take turns being xor-ed with a keyed
hash of the other half, which is a bijection of ``[0, 2**m)`` whatever the halves' sizes. A value
that lands at or past ``total`` is put through the network again (cycle walking) until it falls
inside; since ``2**m < 2 * total`` (above 2 samples), that takes under two passes on average. The
round keys come from ``numpy.random.SeedSequence([seed, epoch])``: the order depends on the seed
and the epoch only. Every step is vectorised over an array of positions.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: Half-rounds of the Feistel network (each updates one half from the other).
_ROUNDS = 8

_Uint64s = np.ndarray[Any, np.dtype[np.uint64]]


def _u64(value: int) -> _Uint64s:
    """``value`` as a 0-d uint64 array (cheaper than a numpy scalar as an operand)."""
    return np.array(value, dtype=np.uint64)


_MIX_1 = _u64(0xFF51AFD7ED558CCD)
_MIX_2 = _u64(0xC4CEB9FE1A85EC53)
_SHIFT = _u64(33)


def _hash(values: _Uint64s, key: _Uint64s) -> _Uint64s:
    """A keyed 64-bit hash of each value (MurmurHash3's finaliser over ``value ^ key``)."""
    mixed = values ^ key
    mixed ^= mixed >> _SHIFT
    mixed *= _MIX_1
    mixed ^= mixed >> _SHIFT
    mixed *= _MIX_2
    mixed ^= mixed >> _SHIFT
    return mixed


class EpochOrder:
    """The samples at positions of epoch ``epoch`` of ``total`` samples: the same on every rank,
    worker and run for the same ``(seed, epoch)``."""

    __slots__ = ("_high_mask", "_keys", "_low_bits", "_low_mask", "total")

    def __init__(self, total: int, epoch: int, seed: int, shuffle: bool) -> None:
        if total < 1:
            raise ValueError("the dataset is empty")
        self.total = total
        bits = max(2, (total - 1).bit_length())
        self._low_bits = _u64(bits // 2)
        self._low_mask = _u64((1 << (bits // 2)) - 1)
        self._high_mask = _u64((1 << (bits - bits // 2)) - 1)
        self._keys: tuple[_Uint64s, ...] | None = None
        if shuffle:
            state = np.random.SeedSequence([seed, epoch]).generate_state(_ROUNDS, np.uint64)
            self._keys = tuple(_u64(int(key)) for key in state)

    def at(self, positions: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """The sample ids (int64) at ``positions`` (integers in ``[0, total)``)."""
        positions = np.asarray(positions, dtype=np.int64)
        if self._keys is None:
            return positions.copy()
        values = self._permute(positions.astype(np.uint64))
        outside = np.flatnonzero(values >= self.total)
        while outside.size:
            values[outside] = self._permute(values[outside])
            outside = outside[values[outside] >= self.total]
        return values.astype(np.int64)

    def _permute(self, values: _Uint64s) -> _Uint64s:
        """One pass of the Feistel network: a bijection of ``[0, 2**bits)``."""
        assert self._keys is not None
        high, low = values >> self._low_bits, values & self._low_mask
        for round_index, key in enumerate(self._keys):
            if round_index % 2 == 0:
                high ^= _hash(low, key) & self._high_mask
            else:
                low ^= _hash(high, key) & self._low_mask
        result: _Uint64s = (high << self._low_bits) | low
        return result


def orders_at(
    totals: np.ndarray[Any, Any],
    seeds: list[int],
    epoch: int,
    group: np.ndarray[Any, Any],
    offsets: np.ndarray[Any, Any],
) -> np.ndarray[Any, Any]:
    """Many epoch orders at once: for each ``i``,
    ``EpochOrder(totals[g], epoch, seeds[g], True).at(offsets[i])`` with ``g = group[i]`` (the
    same values), evaluated for every group together instead of one group at a time."""
    offsets = np.asarray(offsets, dtype=np.int64)
    if offsets.size == 0:
        return offsets.copy()
    limits = np.asarray(totals, dtype=np.int64)
    if limits.min(initial=1) < 1:
        raise ValueError("the dataset is empty")
    bits = np.array([max(2, (int(t) - 1).bit_length()) for t in limits.tolist()], np.uint64)
    low_bits = bits // _u64(2)
    one = _u64(1)
    low_mask = (one << low_bits) - one
    high_mask = (one << (bits - low_bits)) - one
    keys = np.array(
        [np.random.SeedSequence([s, epoch]).generate_state(_ROUNDS, np.uint64) for s in seeds],
        dtype=np.uint64,
    ).reshape(len(seeds), _ROUNDS)

    def permute(values: _Uint64s, at: np.ndarray[Any, Any]) -> _Uint64s:
        shift, lows, highs = low_bits[at], low_mask[at], high_mask[at]
        high, low = values >> shift, values & lows
        for round_index in range(_ROUNDS):
            key = keys[at, round_index]
            if round_index % 2 == 0:
                high ^= _hash(low, key) & highs
            else:
                low ^= _hash(high, key) & lows
        result: _Uint64s = (high << shift) | low
        return result

    group = np.asarray(group, dtype=np.intp)
    values = permute(offsets.astype(np.uint64), group)
    bounds = limits.astype(np.uint64)[group]
    outside = np.flatnonzero(values >= bounds)
    while outside.size:
        values[outside] = permute(values[outside], group[outside])
        outside = outside[values[outside] >= bounds[outside]]
    return values.astype(np.int64)
