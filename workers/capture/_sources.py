"""Building and probing one shard's source and feeders. Runs in the worker.

``source(shard)`` and ``feeders(shard)`` are the user's; this module calls them, checks what they
return, and learns what the loader must know before the first epoch: how many batches the shard
yields per epoch (when the source can tell) and, for a reader that pads its shard, where the
shard's real samples end, so padded rows are flagged like ``sharded_source``'s.

Behind a ``sharded_source``/``sharded_files`` root, :func:`build_sources` hands the
:class:`~workers.sources.BatchedSamples` the worker's :class:`~workers.sources.SampleControl` (the
worker's for its whole life) and a new :class:`~workers.sources.FeedState` (this build's,
kept in :attr:`Sources.feed`); :func:`delivery_info` takes each delivered batch's record from it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ipc import wire

from .. import dali
from ..sources import SKIP_DAMAGED, STARTED_TOGETHER, BatchedSamples, FeedState, SampleControl
from ..spec import Shard, WorkerSpec
from ._phase import Phase


@dataclass
class Sources:
    """One shard's driving source and feeders, built for one epoch."""

    source: Any
    #: The ``sharded_source``/``sharded_files`` bookkeeping behind the source, if it is one.
    sampled: BatchedSamples | None = None
    #: The batches the sampled source handed to DALI, and whether it runs on across epochs.
    feed: FeedState = field(default_factory=FeedState)
    feeders: dict[str, Any] = field(default_factory=dict)
    #: Batches per epoch, or None when the source cannot tell in advance.
    steps_per_epoch: int | None = None
    #: Batches of the epoch these sources were built for (fewer when resumed mid-epoch).
    first_epoch_steps: int | None = None
    #: For a reader that sticks to its shard and pads its last batch: the shard's real samples
    #: (rows past them are padding). None otherwise.
    reader_real_samples: int | None = None

    def sampling(self) -> wire.Sampling | None:
        """What the trainer needs to save and check positions; None when it cannot."""
        sampled = self.sampled
        return None if sampled is None else sampled.sampling


def build_sources(
    spec: WorkerSpec,
    shard: Shard,
    set_phase: Callable[[Phase], None],
    control: SampleControl,
) -> Sources:
    """Call ``source(shard)`` and ``feeders(shard)``, check and probe what they return.
    ``control``: the worker's, handed to a sharded source (see the module docstring)."""
    dali.seed_random(shard.seed + shard.epoch * shard.count)
    set_phase(Phase.SOURCE)
    skipping = SKIP_DAMAGED.set(control.skip)
    together = STARTED_TOGETHER.set(spec.started_together)
    try:
        source = spec.source(shard)
    finally:
        STARTED_TOGETHER.reset(together)
        SKIP_DAMAGED.reset(skipping)
    problem = dali.describe_source_error(source)
    if problem is not None:
        raise TypeError(problem)
    built = Sources(source, dali.sharded_samples(source))
    probed = dali.probe_reader(source, spec.batch_size)
    sampled = built.sampled
    if sampled is not None:
        sampled.bind(control, built.feed)
        built.steps_per_epoch = len(sampled)
        built.first_epoch_steps = sampled.first_epoch_steps
        if sampled.batch_size != spec.batch_size:
            raise ValueError(
                f"sharded_source/sharded_files were given batch_size={sampled.batch_size} but "
                f"the Loader's batch_size is {spec.batch_size}: take both from one place "
                "(e.g. functools.partial)"
            )
    elif probed is not None and dali.sticks_to_shard(source):
        built.steps_per_epoch = built.first_epoch_steps = probed.steps
        if dali.pads_last_batch(source):
            built.reader_real_samples = probed.real
    if probed is not None and probed.real == 0:
        raise ValueError(
            f"{shard.describe()} has no samples: the dataset has fewer samples than "
            f"shards ({shard.count}); use fewer workers or ranks, or more data"
        )
    if spec.feeders is not None:
        set_phase(Phase.FEEDERS)
        built.feeders = check_feeders(spec.feeders(shard))
    return built


def check_feeders(made: Any) -> dict[str, Any]:
    if not isinstance(made, Mapping):
        raise TypeError(
            f"feeders(shard) must return a dict of name -> ndd.ExternalSource, "
            f"got {type(made).__name__}"
        )
    for name, feeder in made.items():
        if not dali.is_external_source(feeder):
            raise TypeError(
                f"feeder {name!r} must be an ndd.ExternalSource, got {type(feeder).__name__}"
            )
    return dict(made)


def delivery_info(
    sources: Sources, step: int, batch_size: int
) -> tuple[int, tuple[int, ...], tuple[int, ...], tuple[str, ...]]:
    """Of step ``step``'s batch: rows of padding, replaced rows, skipped sample ids and their
    names. Padding is counted by ``sharded_source``, or is what lies past the shard's real
    samples for a reader that sticks to its shard and pads its last batch."""
    sampled, fed = sources.sampled, sources.feed.delivered()  # only a sampled source feeds
    if sampled is not None and fed is not None:
        names = tuple(sampled.name(index) for index in fed.skipped)
        return fed.padded, fed.replaced, fed.skipped, names
    padded = 0
    if sources.reader_real_samples is not None:
        rows = (step + 1) * batch_size
        padded = max(0, min(batch_size, rows - sources.reader_real_samples))
    return padded, (), (), ()
