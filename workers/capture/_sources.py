"""Building and probing one shard's source and feeders. Runs in the worker.

The Loader's ``source`` is a dataset definition (:class:`~workers.sources.Definition`:
``FilesDataset``, ``TarsDataset``, ``SamplesDataset``, ``MixDataset``) or the user's
``source(shard)``; ``feeders(shard)`` is the user's too. This module opens the one or calls the
other, checks what comes back, and learns what the loader must know before the first epoch: how
many batches the shard yields per epoch (when the source can tell) and, for a reader that pads
its shard, where the shard's real samples end, so padded rows are flagged like a sampled
source's.

A definition is opened here with the loader's one ``batch_size`` into a
:class:`~workers.sources.BatchedSamples` (DALI-free numpy batches); ``source(shard)`` may
return one too (what ``sharded_source``/``sharded_files``/``sharded_tars``/``sharded_mix``
return; their batch size is checked against the loader's). Either way :func:`build_sources`
hands it the worker's :class:`~workers.sources.SampleControl` (the worker's for its whole life)
and a new :class:`~workers.sources.FeedState` (this build's, kept in :attr:`Sources.feed`), and
makes its DALI root (an ``ndd.ExternalSource``, :func:`workers.dali.batches_root`);
:func:`delivery_info` takes each delivered batch's record from it. A DALI reader or an
``ndd.ExternalSource`` that ``source(shard)`` returns is the root as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ipc import wire

from .. import dali
from ..sources import (
    SKIP_DAMAGED,
    STARTED_TOGETHER,
    BatchedSamples,
    Definition,
    FeedState,
    SampleControl,
)
from ..spec import Shard, WorkerSpec
from ._phase import Phase


@dataclass
class Sources:
    """One shard's driving source and feeders, built for one epoch."""

    source: Any
    #: The batches behind the source (a definition's, or a ``sharded_*`` function's), if any.
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
    """Open the definition or call ``source(shard)``, and ``feeders(shard)``; check and probe
    what they give. ``control``: the worker's, bound to sampled batches (see the module
    docstring)."""
    dali.seed_random(shard.seed + shard.epoch * shard.count)
    set_phase(Phase.SOURCE)
    made = _open_source(spec, shard, control)
    if isinstance(made, BatchedSamples):
        built = _sampled_sources(made, spec, control)
    else:
        problem = dali.describe_source_error(made)
        if problem is not None:
            raise TypeError(problem)
        built = _reader_sources(made, spec, shard)
    if spec.feeders is not None:
        set_phase(Phase.FEEDERS)
        built.feeders = check_feeders(spec.feeders(shard))
    return built


def _open_source(spec: WorkerSpec, shard: Shard, control: SampleControl) -> Any:
    """The definition opened with the loader's batch size, or what ``source(shard)`` returns;
    either with the worker's ``on_error`` and pool token in reach (a tar source leaves out a
    damaged shard under ``on_error="skip"``; workers started together share a listing)."""
    skipping = SKIP_DAMAGED.set(control.skip)
    together = STARTED_TOGETHER.set(spec.started_together)
    try:
        if isinstance(spec.source, Definition):
            return spec.source.batched(shard, spec.batch_size)
        return spec.source(shard)
    finally:
        STARTED_TOGETHER.reset(together)
        SKIP_DAMAGED.reset(skipping)


def _sampled_sources(sampled: BatchedSamples, spec: WorkerSpec, control: SampleControl) -> Sources:
    """Batches of a definition or a ``sharded_*`` function: bound to the worker's control state
    and put under a DALI root made here."""
    if sampled.batch_size != spec.batch_size:
        raise ValueError(
            f"sharded_source/sharded_files/sharded_tars/sharded_mix were given "
            f"batch_size={sampled.batch_size} but the Loader's batch_size is "
            f"{spec.batch_size}: pass the dataset's definition to the Loader instead "
            f"(Loader(FilesDataset(root), step, batch_size={spec.batch_size}), or TarsDataset, "
            "SamplesDataset, MixDataset), which gives batch_size once, or take both from one place"
        )
    built = Sources(dali.batches_root(sampled), sampled)
    sampled.bind(control, built.feed)
    built.steps_per_epoch = len(sampled)
    built.first_epoch_steps = sampled.first_epoch_steps
    return built


def _reader_sources(source: Any, spec: WorkerSpec, shard: Shard) -> Sources:
    """A DALI reader or ``ndd.ExternalSource`` that ``source(shard)`` returned: a reader is
    opened now (a bad path or an empty shard fails at start) and its batches counted when it
    sticks to its shard."""
    built = Sources(source)
    probed = dali.probe_reader(source, spec.batch_size)
    if probed is None:
        return built
    if probed.real == 0:
        raise ValueError(
            f"{shard.describe()} has no samples: the dataset has fewer samples than "
            f"shards ({shard.count}); use fewer workers or ranks, or more data"
        )
    if dali.sticks_to_shard(source):
        built.steps_per_epoch = built.first_epoch_steps = probed.steps
        if dali.pads_last_batch(source):
            built.reader_real_samples = probed.real
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
) -> tuple[int, tuple[int, ...], tuple[int, ...], tuple[str, ...], tuple[tuple[str, int], ...]]:
    """Of step ``step``'s batch: rows of padding, replaced rows, skipped sample ids and their
    names, and (member, rows) of the optional members given their default. Padding is counted
    by ``sharded_source``, or is what lies past the shard's real samples for a reader that
    sticks to its shard and pads its last batch."""
    sampled, fed = sources.sampled, sources.feed.delivered()  # only a sampled source feeds
    if sampled is not None and fed is not None:
        names = tuple(sampled.name(index) for index in fed.skipped)
        return fed.padded, fed.replaced, fed.skipped, names, fed.defaulted
    padded = 0
    if sources.reader_real_samples is not None:
        rows = (step + 1) * batch_size
        padded = max(0, min(batch_size, rows - sources.reader_real_samples))
    return padded, (), (), (), ()
