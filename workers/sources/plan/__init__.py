"""The planning arithmetic: which samples a shard owes, in which order, batch by batch, and the
worker's control state those batches are made under. Runs in the worker and in the trainer (which
imports it through this face, never module by module).

* ``_positions``: layouts, positions, the batches a shard owes, a saved position continued;
* ``_epoch_order``: an epoch's seeded order of the samples;
* ``_parts``: a dataset's parts as a state records them, and how two of them differ;
* ``_control``: the worker's control state (``on_error``, the samples known to fail, the batches
  in flight, the pool's token), made by the worker;
* ``_skips``: why a sample's ``load`` failed, as the kind the skip-limit error names;
* ``_sampling``: :class:`BatchedSamples` (full batches of a shard, padding flagged, a saved
  position resumed) over an :class:`OpenedSource` (any ``load(index)``), with :class:`Batching`.

May import: ``ipc``, the standard library, numpy, and from ``workers`` only :mod:`workers.spec`
and :mod:`workers.transport` (an error's context). Nothing of the other wings of
:mod:`workers.sources`: they all import this.
"""

from ._control import (
    REPORT_PROGRESS,
    SKIP_DAMAGED,
    STARTED_TOGETHER,
    FedBatch,
    FeedState,
    OpenedOnce,
    SampleControl,
)
from ._epoch_order import EpochOrder, orders_at
from ._parts import decode_parts, describe_difference, encode_parts
from ._positions import (
    Batch,
    Order,
    Orders,
    continue_from,
    every_shard_steps,
    plan_epoch,
    shard_batches,
    shard_indices,
    shard_steps,
    steps_left,
    steps_per_epoch,
)
from ._sampling import BatchedSamples, Batching, Defaulted, OpenedSource
from ._skips import LoadSkip, MemberMissing, SampleLeftOut, load_skip

__all__ = [
    "REPORT_PROGRESS",
    "SKIP_DAMAGED",
    "STARTED_TOGETHER",
    "Batch",
    "BatchedSamples",
    "Batching",
    "Defaulted",
    "EpochOrder",
    "FedBatch",
    "FeedState",
    "LoadSkip",
    "MemberMissing",
    "OpenedOnce",
    "OpenedSource",
    "Order",
    "Orders",
    "SampleControl",
    "SampleLeftOut",
    "continue_from",
    "decode_parts",
    "describe_difference",
    "encode_parts",
    "every_shard_steps",
    "load_skip",
    "orders_at",
    "plan_epoch",
    "shard_batches",
    "shard_indices",
    "shard_steps",
    "steps_left",
    "steps_per_epoch",
]
