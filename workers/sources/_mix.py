"""``MixDataset`` (and ``sharded_mix``): datasets mixed in fixed proportions, sharded as one
source. Runs in the worker (the definition is made in the trainer too).

The mix, not each dataset, does the sharding: its sources are *definitions* of whole datasets
(:class:`FilesDataset`, :class:`TarsDataset`, :class:`SamplesDataset`), opened in every worker.

**A mixed epoch** of ``E`` samples takes exactly ``n_s = round(weight_s * E)`` samples from source
``s`` (the epoch then holds ``sum(n_s)`` samples). Each source keeps a *running permutation*: its
samples in a seeded order (its own orders: a tar source's reads a few shards at a time), followed
by another permutation when it runs out (a small source repeats then; the worker of shard 0 logs
when a source starts a new permutation). Epoch ``e`` takes draws ``[e * n_s, (e + 1) * n_s)`` of
that stream: the cursor of every source at every epoch's start is ``e * n_s``, so a state needs no
more than the epoch and position it already holds.

**Interleaving**: the epoch is cut into blocks of about :data:`BLOCK` samples; block ``j`` takes
from source ``s`` the draws ``[floor(n_s * j / B), floor(n_s * (j + 1) / B))`` (``B`` blocks), so
every source is spread evenly over the epoch, and a seeded permutation of each block (by seed,
epoch and block) mixes its rows. Positions are computed per position, in O(sources) each, so the
usual planning holds: a worker plans its own shard only, resume and reshard are exact, and the
per-source counts of an interrupted epoch are those of an uninterrupted one. Within a block a
source's draws are consecutive in its stream, so a tar source is still read a few shards at a time.

Sample ids are stable: source ``s``'s sample ``i`` is ``offset_s + i`` (sources in the order
given), which is what the bad-sample registry, ``batch.info.skipped`` and ``skipped_names``
(``<source>:<name>``) use. ``source_output=True`` adds a last output: each row's source, as its
position in ``sources`` (int32).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field, replace
from typing import Any

import numpy as np

from ..spec import Shard
from ._datasets import (
    Dataset,
    Definition,
    FilesDataset,
    ParquetDataset,
    SamplesDataset,
    TarsDataset,
)
from ._separated import SeparatedOrder, reach
from .plan import BatchedSamples, Batching, Defaulted, EpochOrder, OpenedSource, Order

logger = logging.getLogger("workers")

#: Samples per block of a mixed epoch (see the module docstring).
BLOCK = 4096

_Int64s = np.ndarray[Any, np.dtype[np.int64]]


class MixPlan:
    """Where each source's draws of an epoch lie (see the module docstring): pure arithmetic
    over the per-epoch counts, the same in every worker."""

    def __init__(self, counts: Sequence[int]) -> None:
        self.counts = np.asarray(counts, dtype=np.int64)
        self.total = int(self.counts.sum())
        self.blocks = max(1, math.ceil(self.total / BLOCK))

    def starts(self, blocks: _Int64s) -> _Int64s:
        """Where blocks ``blocks`` start, per source (shape ``(len(blocks), sources)``)."""
        taken: _Int64s = (self.counts[None, :] * blocks[:, None]) // self.blocks
        return taken

    def block_of(self, positions: _Int64s) -> _Int64s:
        """The block of each position (blocks start at ``sum(starts)``, increasing)."""
        if not len(positions):  # (a worker whose part of an epoch is empty)
            return np.zeros(0, np.int64)
        low = np.clip(positions * self.blocks // max(1, self.total) - 2, 0, self.blocks)
        high = np.clip(low + 5, 0, self.blocks)
        candidates = np.arange(int(low.min()), int(high.max()) + 1, dtype=np.int64)
        firsts = self.starts(candidates).sum(axis=1)
        found: _Int64s = candidates[np.searchsorted(firsts, positions, side="right") - 1]
        return found


class MixOrder:
    """The stable sample ids at positions of one mixed epoch."""

    def __init__(self, mix: Mixture, epoch: int, parts: np.ndarray[Any, Any] | None = None) -> None:
        # (``parts`` are not used: a mix draws from its sources' streams, whichever worker reads)
        self.mix, self.epoch = mix, epoch

    def draws(self, positions: np.ndarray[Any, Any]) -> tuple[_Int64s, _Int64s]:
        """(source, draw in this epoch) of each position."""
        mix, plan = self.mix, self.mix.plan
        positions = np.asarray(positions, dtype=np.int64)
        blocks = plan.block_of(positions)
        sources = np.empty_like(positions)
        draws = np.empty_like(positions)
        for block in np.unique(blocks).tolist():
            chosen = blocks == block
            edges = plan.starts(np.array([block, block + 1], dtype=np.int64))
            taken = edges[1] - edges[0]  # draws of each source in this block
            first = int(edges[0].sum())
            key = np.random.SeedSequence([mix.seed, self.epoch, block]).generate_state(1)
            rows = EpochOrder(int(taken.sum()), self.epoch, int(key[0]), mix.shuffle).at(
                positions[chosen] - first
            )
            bounds = np.cumsum(taken)
            source = np.searchsorted(bounds, rows, side="right")
            sources[chosen] = source
            draws[chosen] = edges[0][source] + rows - (bounds[source] - taken[source])
        return sources, draws

    def at(self, positions: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        sources, draws = self.draws(positions)
        ids = np.empty_like(sources)
        for source in np.unique(sources).tolist():
            chosen = sources == source
            stream = self.epoch * int(self.mix.plan.counts[source]) + draws[chosen]
            ids[chosen] = self.mix.offsets[source] + self.mix.stream_samples(source, stream)
        return ids


@dataclass
class Mixture:
    """The opened sources of a mix and its per-epoch counts."""

    names: list[str]
    sources: list[OpenedSource]
    plan: MixPlan
    seed: int
    shuffle: bool
    #: the batch size: how far in a source's stream one batch reaches (:func:`reach`)
    batch_size: int = 1
    offsets: _Int64s = field(init=False)
    _orders: dict[tuple[int, int, bool], Order] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        sizes = [source.total for source in self.sources]
        self.offsets = np.concatenate([np.zeros(1, np.int64), np.cumsum(sizes)])

    def source_seed(self, source: int) -> int:
        return source_seed(self.seed, self.names[source])

    def order(self, source: int, turn: int) -> Order:
        """Source ``source``'s permutation number ``turn`` of its running stream: a shuffled
        one's first positions kept clear of the samples that ended the turn before
        (:class:`SeparatedOrder`: no batch holds a sample twice where a turn ends)."""
        if turn == 0 or not self.shuffle:
            return self._base(source, turn)
        key = (source, turn, True)
        order = self._orders.get(key)
        if order is None:
            total, batch = self.sources[source].total, self.batch_size
            before, after = reach(self.plan, source, total, turn, batch)
            kept = reach(self.plan, source, total, turn + 1, batch)[0]
            previous = self._base(source, turn - 1)
            base = self._base(source, turn)
            order = SeparatedOrder(base, previous, total, before, after, kept)
            self._orders[key] = order
        return order

    def _base(self, source: int, turn: int) -> Order:
        key = (source, turn, False)
        order = self._orders.get(key)
        if order is None:
            opened, seed = self.sources[source], self.source_seed(source)
            if opened.orders is not None and self.shuffle:
                order = opened.orders(turn)
            else:
                order = EpochOrder(opened.total, turn, seed, self.shuffle)
            if len(self._orders) > 8 * len(self.sources):
                self._orders.clear()
            self._orders[key] = order
        return order

    def stream_samples(self, source: int, stream: _Int64s) -> _Int64s:
        """The samples of ``source`` at positions ``stream`` of its running stream."""
        total = self.sources[source].total
        turns = stream // total
        found = np.empty_like(stream)
        for turn in np.unique(turns).tolist():
            chosen = turns == turn
            found[chosen] = self.order(source, turn).at(stream[chosen] - turn * total)
        return found

    def source_of(self, ids: np.ndarray[Any, Any]) -> _Int64s:
        found: _Int64s = np.searchsorted(self.offsets, ids, side="right") - 1
        return found


class MixLoader:
    """``load(index)`` of a mix: the source's sample (and, with ``source_output``, the source)."""

    def __init__(
        self, mix: Mixture, source_output: bool, casts: Sequence[Sequence[Any]] = ()
    ) -> None:
        self.mix, self.source_output = mix, source_output
        self._labels = [np.full(1, k, dtype=np.int32) for k in range(len(mix.sources))]
        #: per source, per output, the dtype its samples are cast to (None: as they come)
        self._casts = [list(c) if any(d is not None for d in c) else None for c in casts]

    def _split(self, index: int) -> tuple[int, int]:
        source = int(self.mix.source_of(np.array([index]))[0])
        return source, index - int(self.mix.offsets[source])

    def __call__(self, index: int) -> Any:
        source, sample = self._split(index)
        loaded = self.mix.sources[source].load(sample)
        outputs = loaded if isinstance(loaded, tuple) else (loaded,)
        casts = self._casts[source] if source < len(self._casts) else None
        if casts is not None:
            outputs = tuple(
                value if dtype is None else np.asarray(value, dtype=dtype)
                for value, dtype in zip(outputs, casts, strict=True)
            )
        if self.source_output:
            outputs = (*outputs, self._labels[source])
        if isinstance(loaded, Defaulted):  # (the members it lacked still counted)
            outputs = Defaulted(outputs, loaded.members)
        return outputs if len(outputs) > 1 else outputs[0]

    def describe(self, index: int) -> str:
        source, sample = self._split(index)
        describe = self.mix.sources[source].describe
        return f"{self.mix.names[source]}:{sample if describe is None else describe(sample)}"

    def expect(self, epoch: int, ids: Sequence[np.ndarray[Any, Any]]) -> None:
        """Hand each source that reads ahead its part of the epoch's batches."""
        for source, opened in enumerate(self.mix.sources):
            expect = getattr(opened.load, "expect", None)
            if expect is None:
                continue
            first, last = self.mix.offsets[source], self.mix.offsets[source + 1]
            expect(epoch, [chunk[(chunk >= first) & (chunk < last)] - first for chunk in ids])

    def passed(self, epoch: int, step: int) -> None:
        for opened in self.mix.sources:
            passed = getattr(opened.load, "passed", None)
            if passed is not None:
                passed(epoch, step)


def source_seed(seed: int, name: str) -> int:
    """The seed of source ``name``'s permutations: the loader's seed and the source's name."""
    digest = hashlib.sha256(f"{seed}\0{name}".encode()).digest()
    return int.from_bytes(digest[:7], "little")


def mix_counts(weights: Mapping[str, float], names: Sequence[str], epoch_size: int) -> list[int]:
    """``round(weight * epoch_size)`` per source (halves up), weights normalised to sum 1."""
    total = float(sum(weights[name] for name in names))
    return [math.floor(weights[name] / total * epoch_size + 0.5) for name in names]


def _check_weights(names: list[str], weights: Mapping[str, float]) -> None:
    if not isinstance(weights, Mapping):
        raise TypeError(
            f"weights must be a dict of each source's name and its weight "
            f"({{{', '.join(f'{name!r}: 1.0' for name in names)}}}), got "
            f"{type(weights).__name__}"
        )
    if set(weights) != set(names):
        missing, extra = set(names) - set(weights), set(weights) - set(names)
        raise ValueError(
            f"weights must name every source once: missing {sorted(missing)}, "
            f"unknown {sorted(extra)}"
        )
    for name, weight in weights.items():
        number = not isinstance(weight, bool) and isinstance(weight, (int, float))
        if not number or not weight > 0 or not math.isfinite(weight):
            raise ValueError(f"the weight of {name!r} must be a finite number > 0, got {weight!r}")


def _check_outputs(names: list[str], sources: list[OpenedSource]) -> list[list[Any]]:
    """Every source gives the same outputs as the first, by position: count, ranks and dtypes
    (integers, or floats, of other widths cast to the wider); per source, per output, the dtype
    its samples are cast to (None: as they come)."""

    def outputs(k: int) -> list[np.ndarray[Any, Any]]:
        loaded = sources[k].load(0)
        return [np.asarray(a) for a in (loaded if isinstance(loaded, tuple) else (loaded,))]

    first = outputs(0)
    for k in range(1, len(sources)):
        if sources[k].num_outputs != sources[0].num_outputs:
            raise ValueError(
                f"source {names[k]!r} gives {sources[k].num_outputs} outputs but "
                f"{names[0]!r} gives {sources[0].num_outputs}: every source of a mix must give "
                "the same outputs"
            )
    # outputs go to the step by position: their names may differ (a Parquet "image" column
    # beside a tar's "jpg" member); integers of other widths (a tar's int32 "cls", a Parquet
    # int64 "label") and floats are cast to the wider type, anything else must match
    given = [first, *(outputs(k) for k in range(1, len(sources)))]  # (source 0 loaded once)
    targets = []
    for column in range(len(first)):
        arrays = [found[column] for found in given]
        target = arrays[0].dtype
        for k, array in enumerate(arrays[1:], start=1):
            if array.ndim != arrays[0].ndim or not _castable(array.dtype, arrays[0].dtype):
                called = _output_name(sources, k, column)
                raise ValueError(
                    f"output {column}{called} of source {names[k]!r} is {array.dtype} of rank "
                    f"{array.ndim} but {names[0]!r} gives {arrays[0].dtype} of rank "
                    f"{arrays[0].ndim}{_output_name(sources, 0, column)}: every source of a "
                    "mix must give the same outputs, in the same order (integers of other "
                    "widths are cast to the wider integer, floats to the wider float; bytes, "
                    "uint8, are bytes)"
                )
            target = np.promote_types(target, array.dtype)
        if arrays[0].dtype.kind in "iu" and target.kind not in "iu":  # (uint64 with int64)
            raise ValueError(
                f"output {column}{_output_name(sources, 0, column)} mixes integers no integer "
                f"type holds all of ({', '.join(sorted({str(a.dtype) for a in arrays}))}): "
                "give every source the same integer type"
            )
        targets.append(target)
    return [
        [
            None if found[column].dtype == targets[column] else targets[column]
            for column in range(len(first))
        ]
        for found in given
    ]


def _castable(a: np.dtype[Any], b: np.dtype[Any]) -> bool:
    """The same dtype, or both integers (neither uint8: bytes, as every source gives encoded
    images, text and keys), or both floats."""
    numbers = a.kind in "iu" and b.kind in "iu" and np.dtype(np.uint8) not in (a, b)
    return a == b or numbers or (a.kind == b.kind == "f")


def _output_name(sources: list[OpenedSource], k: int, column: int) -> str:
    names = sources[k].names
    return f" ({names[column]!r})" if names is not None and column < len(names) else ""


def _check_sources(sources: Mapping[str, Dataset]) -> list[str]:
    """The names of ``sources``, each a dataset's definition (else a clear error)."""
    if not isinstance(sources, Mapping) or not sources:
        raise ValueError("sources must be a non-empty dict of name -> dataset")
    for name, dataset in sources.items():
        if not isinstance(dataset, (FilesDataset, TarsDataset, ParquetDataset, SamplesDataset)):
            raise TypeError(
                f"source {name!r} must be a FilesDataset, TarsDataset, ParquetDataset or "
                "SamplesDataset "
                f"(a dataset's definition, not a per-shard source), got {type(dataset).__name__}"
            )
        if not dataset.shuffle or dataset.drop_last:
            raise ValueError(
                f"source {name!r}: shuffle and drop_last of a mixture are the mixture's: set "
                "them on MixDataset (or sharded_mix), not on its sources"
            )
        if isinstance(dataset, SamplesDataset) and dataset.pass_epoch:
            raise ValueError(
                f"source {name!r}: pass_epoch=True is not for a mixture (a mixed source's "
                "samples are drawn across epochs); draw from the sample id in load() instead"
            )
    return list(sources)


@dataclass(frozen=True)
class MixDataset(Definition):
    """Datasets mixed in fixed proportions, sharded as one: ``Loader(MixDataset(sources,
    weights), step, batch_size=64)``.

    ``sources``: name -> dataset definition (:class:`FilesDataset`, :class:`TarsDataset`,
    :class:`SamplesDataset`, their ``shuffle``/``drop_last`` left as they are: the mix's own
    decide); ``weights``: name -> a positive weight (normalised). Each epoch of ``epoch_size``
    samples (default: all the sources' samples together) takes exactly
    ``round(weight * epoch_size)`` of each source, without replacement from that source's
    running permutation (see the module docstring). ``source_output``: a last output, each
    row's source. The same guarantees as :func:`sharded_source`.
    """

    sources: Mapping[str, Dataset]
    weights: Mapping[str, float]
    _: KW_ONLY
    epoch_size: int | None = None
    source_output: bool = False
    shuffle: bool = True
    drop_last: bool = False

    def __post_init__(self) -> None:
        _check_weights(_check_sources(self.sources), self.weights)

    def server_needs(self) -> tuple[str, ...]:
        found = (need for dataset in self.sources.values() for need in dataset.server_needs())
        return tuple(dict.fromkeys(found))

    def _batched(self, shard: Shard, batching: Batching) -> BatchedSamples:
        names = list(self.sources)
        seed = shard.seed - shard.index
        opened = [self.sources[name].open(shard, source_seed(seed, name)) for name in names]
        casts = _check_outputs(names, opened)
        epoch_size = self.epoch_size
        size = sum(source.total for source in opened) if epoch_size is None else epoch_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"epoch_size must be a positive number of samples, got {epoch_size!r}")
        counts = mix_counts(self.weights, names, size)
        if min(counts) < 1:
            empty = [name for name, count in zip(names, counts, strict=True) if count < 1]
            raise ValueError(
                f"an epoch of {size} samples takes none from {empty}: raise epoch_size or "
                "their weights"
            )
        plan = MixPlan(counts)
        mix = Mixture(names, opened, plan, seed, batching.shuffle, batching.batch_size)
        digest = hashlib.sha256()
        for name, source, count in zip(names, opened, counts, strict=True):
            digest.update(f"{name}\0{source.total}\0{source.fingerprint}\0{count}\n".encode())
        if shard.index == 0:
            _log_turns(mix, shard.epoch)
        return BatchedSamples(
            shard,
            mix.plan.total,
            MixLoader(mix, self.source_output, casts),
            # (the order is the mix's: ``shuffle`` is applied there)
            replace(batching, shuffle=True),
            num_outputs=opened[0].num_outputs + int(self.source_output),
            # (mix2: its sources' later permutations kept apart from the ones before; a
            # state of mix: is of 0.3's order, loaded between epochs only)
            fingerprint=f"mix2:{digest.hexdigest()[:16]}",
            orders=functools.partial(MixOrder, mix),
            left_out=tuple(line for source in opened for line in source.left_out),
        )


def sharded_mix(
    shard: Shard,
    sources: Mapping[str, Dataset],
    *,
    weights: Mapping[str, float],
    batch_size: int,
    epoch_size: int | None = None,
    shuffle: bool = True,
    drop_last: bool = False,
    source_output: bool = False,
) -> Any:
    """Batches of datasets mixed in fixed proportions, for ``source(shard)`` to return: a thin
    wrapper of :class:`MixDataset` (the same arguments; see there) for a hand-written source.
    ``batch_size``: the Loader's; ``Loader(MixDataset(sources, weights), step,
    batch_size=...)`` gives it once."""
    batching = Batching.pick(locals())
    mix = MixDataset(sources, weights, epoch_size=epoch_size, source_output=source_output)
    return mix._batched(shard, batching)


def _log_turns(mix: Mixture, epoch: int) -> None:
    """Say which sources run through their samples more than once per epoch (or will)."""
    for name, source, count in zip(mix.names, mix.sources, mix.plan.counts.tolist(), strict=True):
        if count > source.total:
            logger.info(
                "mix: source %r (%d samples) gives %d per epoch: it repeats, a new permutation "
                "every %.2f epochs",
                name,
                source.total,
                count,
                source.total / count,
            )
        elif count * (epoch + 1) > source.total:
            logger.info(
                "mix: source %r (%d samples, %d per epoch) starts a new permutation every %.2f "
                "epochs",
                name,
                source.total,
                count,
                source.total / count,
            )
