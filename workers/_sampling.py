"""Exactly-once sharding and full batches for ExternalSource roots. Runs in the worker.

DALI refuses a short batch from an ExternalSource root (``Expected batch size B, got n``), and a
reader's own ``pad_last_batch``/``stick_to_shard`` rules decide which samples an epoch holds. The
helpers here let the loader decide instead, deterministically from the seed and the epoch:

* :func:`shard_indices` splits a dataset of ``total`` samples among ``count`` shards for one
  epoch: one global permutation (or the identity), contiguous equal parts. With
  ``drop_last=True`` every shard gets ``total // count`` samples (the rest are dropped this
  epoch); otherwise every shard gets ``ceil(total / count)`` and the shards that run short repeat
  samples from the start of the permutation, flagged as padding. Either way, every shard has the
  same number of samples, so every worker and every rank has the same number of steps.
* :class:`BatchedSamples` turns a shard's samples into full batches of ``batch_size`` (the last
  one padded by repeating its final sample, or dropped), and remembers, per batch yielded, how
  many rows are padding; the worker attaches that count to the delivered batch (``info.padded``).
* :func:`sharded_source` puts both together as an ``ndd.ExternalSource`` ready to return from
  ``source(shard)``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ._shard import Shard

#: Attribute set on an ExternalSource built here; the worker reads padding counts from it.
PADDING_ATTRIBUTE = "_dali_capture_loader_padding"


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
) -> tuple[np.ndarray[Any, Any], int]:
    """This shard's sample indices for ``epoch``, and how many of them (at the end) are padding."""
    if total < 1:
        raise ValueError("the dataset is empty")
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"shard {shard_index} is not in [0, {shard_count})")
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


class BatchedSamples:
    """Re-iterable: each ``iter()`` is one epoch of full batches over this shard's samples.

    ``load(index)`` returns one sample (an array) or a tuple of ``num_outputs`` arrays.
    """

    def __init__(
        self,
        shard: Shard,
        total: int,
        load: Callable[[int], Any],
        batch_size: int,
        *,
        num_outputs: int = 1,
        shuffle: bool = True,
        drop_last: bool = False,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.shard = shard
        self.total = total
        self.load = load
        self.batch_size = batch_size
        self.num_outputs = num_outputs
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = shard.epoch
        self.padding: deque[int] = deque()  # rows of padding, one entry per yielded batch
        self.steps = steps_per_epoch(total, shard.count, batch_size, drop_last)

    def __len__(self) -> int:
        return self.steps

    def batches_for_epoch(self, epoch: int) -> list[tuple[np.ndarray[Any, Any], int]]:
        """(indices, padded rows) of every batch of ``epoch``."""
        indices, padded_tail = shard_indices(
            self.total,
            self.shard.index,
            self.shard.count,
            epoch=epoch,
            seed=self.shard.seed - self.shard.index,  # the loader's seed: same on every shard
            shuffle=self.shuffle,
            drop_last=self.drop_last,
        )
        real = len(indices) - padded_tail
        batches = []
        for start in range(0, len(indices), self.batch_size):
            chunk = indices[start : start + self.batch_size]
            if len(chunk) < self.batch_size:
                if self.drop_last:
                    break
                chunk = np.concatenate([chunk, np.repeat(chunk[-1:], self.batch_size - len(chunk))])
            pad_rows = sum(1 for row in range(start, start + self.batch_size) if row >= real)
            batches.append((chunk, pad_rows))
        return batches

    def _load(self, index: int) -> Any:
        """``load(index)``; an exception leaves tagged with the phase and the sample id."""
        try:
            return self.load(index)
        except Exception as error:
            error._loader_phase = f"load, sample {index}"  # type: ignore[attr-defined]
            raise

    def __iter__(self) -> Iterator[Any]:
        import nvidia.dali.experimental.dynamic as ndd

        epoch = self.epoch
        self.epoch += 1
        for chunk, pad_rows in self.batches_for_epoch(epoch):
            samples = [self._load(int(index)) for index in chunk]
            self.padding.append(pad_rows)
            if self.num_outputs == 1:
                yield ndd.batch([np.asarray(sample) for sample in samples])
            else:
                yield tuple(
                    ndd.batch([np.asarray(sample[k]) for sample in samples])
                    for k in range(self.num_outputs)
                )


def sharded_source(
    shard: Shard,
    total: int,
    load: Callable[[int], Any],
    batch_size: int,
    *,
    num_outputs: int = 1,
    shuffle: bool = True,
    drop_last: bool = False,
) -> Any:
    """An ``ndd.ExternalSource`` root over this shard's part of ``total`` samples.

    Every epoch covers the dataset exactly once across all shards (``drop_last=True`` drops the
    remainder instead of padding), batches are always full, and padded rows are reported in the
    delivered batch's ``info.padded``.
    """
    import nvidia.dali.experimental.dynamic as ndd

    samples = BatchedSamples(
        shard,
        total,
        load,
        batch_size,
        num_outputs=num_outputs,
        shuffle=shuffle,
        drop_last=drop_last,
    )
    source = ndd.ExternalSource(samples, num_outputs=num_outputs, cycle="raise")
    setattr(source, PADDING_ATTRIBUTE, samples)
    return source


def padding_of(source: object) -> BatchedSamples | None:
    found = getattr(source, PADDING_ATTRIBUTE, None)
    return found if isinstance(found, BatchedSamples) else None
