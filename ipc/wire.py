"""The wire contract between a trainer and its workers: every record either side may send.

Both processes import this module; it is the one public contract of ``ipc`` that ``workers`` and
``loader`` share. Every record that crosses the control channel is a frozen, slotted dataclass
defined here; nothing else is ever sent. The channel is a ``socketpair`` created by the trainer
for one worker, so the only bytes ever unpickled come from our own peer process.

Trainer -> worker:

* :class:`StartEpoch` -- run one epoch of the capture loop.
* :class:`AbortEpoch` -- stop the epoch in progress (or the ended one), rebuild the sources.
* :class:`Release` -- fills of slots the trainer no longer uses, each quoted by generation.
* :class:`CudaFreeEvents` -- the trainer's "free" events of a CUDA ring (once per ring).
* :class:`Seek` -- rebuild the sources for an epoch resumed from a saved position.
* :class:`Shutdown` -- leave the command loop and exit.

Worker -> trainer:

* :class:`Hello` -- sources built, waiting for commands (once, first).
* :class:`ArenaReady` -- a new shared-memory arena; exactly one file descriptor follows.
* :class:`CudaRingReady` -- a new CUDA slot ring (IPC memory and "ready" event handles).
* :class:`Signature` -- what the traced loop looks like (every worker and rank must agree).
* :class:`BatchReady` -- a filled slot: where each output lies, epoch, step, padding.
* :class:`EpochEnd` -- the source ended the epoch.
* :class:`EpochAborted` -- answer to AbortEpoch: stopped, sources rebuilt.
* :class:`Sought` -- answer to Seek: sources rebuilt at the position.
* :class:`WorkerFailure` -- an exception, with where it happened; the worker stops after it.
* :class:`SamplesFailed` -- on_error="skip": these samples broke a batch inside DALI; the worker
  exits after it and the trainer starts a new one at that batch, without them.
* :class:`WarningRelay`, :class:`LogRelay` -- a warning or log record to re-emit in the trainer.

A record that breaks this contract (an unknown kind, a slot or arena that does not exist, a
placement outside its slot, a duplicated fill) raises :class:`ProtocolError` on the receiving side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Shape = tuple[int, ...]


class ProtocolError(RuntimeError):
    """A peer sent something the wire contract does not allow."""


def _reduce(record: Any) -> tuple[Any, tuple[Any, ...]]:
    """Pickle a slotted record as its class and field values (much faster than the default)."""
    return type(record), tuple(getattr(record, name) for name in record.__slots__)


# --------------------------------------------------------------------------- trainer -> worker
@dataclass(frozen=True, slots=True)
class StartEpoch:
    """Run one epoch of the worker's capture loop."""

    __reduce__ = _reduce

    epoch: int


@dataclass(frozen=True, slots=True)
class AbortEpoch:
    """The trainer left ``epoch`` early: stop it, rebuild the sources, and answer EpochAborted."""

    __reduce__ = _reduce

    epoch: int


@dataclass(frozen=True, slots=True)
class Release:
    """The trainer no longer uses these fills: ``(slot, generation)`` pairs, each generation
    matching that slot's current fill."""

    __reduce__ = _reduce

    fills: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class CudaFreeEvents:
    """The trainer's interprocess "free" event handles for every slot of a CUDA ring (sent once,
    before any release of that ring)."""

    __reduce__ = _reduce

    arena_id: int
    handles: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class Seek:
    """Rebuild the sources for ``epoch``, resumed from a position: ``segments`` of
    ``(num_shards, batches received per shard)``, oldest first; ``continues`` when this layout
    is the last segment's (each shard goes on with its own batches)."""

    __reduce__ = _reduce

    epoch: int
    segments: tuple[tuple[int, tuple[int, ...]], ...]
    continues: bool


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Leave the command loop and exit."""

    __reduce__ = _reduce


# --------------------------------------------------------------------------- worker -> trainer
@dataclass(frozen=True, slots=True)
class Hello:
    """Sent once the worker built its EvalContext and sources and waits for commands."""

    __reduce__ = _reduce

    pid: int
    num_threads: int
    device_id: int | None
    steps_per_epoch: int | None  # None when the source cannot tell in advance
    #: (total, batch_size, seed, shuffle, drop_last) of a sharded_source/sharded_files root,
    #: whose position the loader can save and resume; None for any other source
    sampling: tuple[int, int, int, bool, bool] | None = None
    #: batches of the epoch the sources were built for (fewer when started mid-epoch)
    first_epoch_steps: int | None = None


@dataclass(frozen=True, slots=True)
class ArenaReady:
    """A new arena for this worker; exactly one file descriptor follows on the channel."""

    __reduce__ = _reduce

    arena_id: int
    slot_size: int
    num_slots: int
    backend: str = "cpu"


@dataclass(frozen=True, slots=True)
class CudaRingReady:
    """A new CUDA slot ring: memory and "ready" event IPC handles, one per slot."""

    __reduce__ = _reduce

    arena_id: int
    device_id: int
    slot_size: int
    memory_handles: tuple[bytes, ...]
    ready_handles: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class OutputSchema:
    """What one named output looks like, as far as every worker must agree."""

    __reduce__ = _reduce

    name: str
    dtype: str
    ndim: int
    layout: str


@dataclass(frozen=True, slots=True)
class Signature:
    """What a worker's traced loop looks like; every worker (and rank) must send the same."""

    __reduce__ = _reduce

    batch_size: int
    device: str
    device_id: int | None
    num_threads: int
    outputs: tuple[OutputSchema, ...]
    output_kind: str  # "dict", "tuple" or "single"
    captured: bool
    capture_requested: bool
    dali_version: str
    trace_seconds: float

    def agreement_fields(self) -> dict[str, object]:
        """The fields that must be equal across workers, by name."""
        return {
            "batch_size": self.batch_size,
            "device": self.device,
            "device_id": self.device_id,
            "num_threads": self.num_threads,
            "output_kind": self.output_kind,
            "outputs": self.outputs,
            "captured": self.captured,
            "dali_version": self.dali_version,
        }


@dataclass(frozen=True, slots=True)
class OutputPlacement:
    """Where one output of a batch lies inside its slot.

    ``shapes`` holds one shape per sample. ``dense`` says every sample has the same shape, so the
    output is one ``(B, ...)`` array; otherwise it is a list of per-sample arrays, back to back.
    """

    __reduce__ = _reduce

    name: str
    dtype: str
    offset: int
    nbytes: int
    shapes: tuple[Shape, ...]
    dense: bool
    layout: str


@dataclass(frozen=True, slots=True)
class BatchReady:
    """A filled slot. ``generation`` counts the fills of that slot; a release must quote it."""

    __reduce__ = _reduce

    epoch: int
    step: int
    arena_id: int
    slot: int
    generation: int
    outputs: tuple[OutputPlacement, ...]
    nbytes: int
    padded: int  # rows at the end of this batch that are padding, not data
    blocked_ns: int  # how long the worker waited for a free slot before this batch
    busy_ns: int  # how long the worker spent producing this batch (step + copy)
    replaced: tuple[int, ...] = ()  # rows that repeat a good sample in place of a skipped one
    skipped: tuple[int, ...] = ()  # sample ids skipped in this batch (on_error="skip")
    skipped_names: tuple[str, ...] = ()  # how each skipped sample is named (a file's path)


@dataclass(frozen=True, slots=True)
class EpochEnd:
    """The worker's source ended ``epoch`` after ``steps`` batches."""

    __reduce__ = _reduce

    epoch: int
    steps: int
    traces: int  # how many times this worker has traced a loop since it started
    rebuilds: int  # how many times this worker rebuilt its sources


@dataclass(frozen=True, slots=True)
class EpochAborted:
    """Answer to AbortEpoch: the epoch is stopped and the sources are ready for the next one."""

    __reduce__ = _reduce

    epoch: int
    rebuilt: bool


@dataclass(frozen=True, slots=True)
class Sought:
    """Answer to Seek: the sources start ``epoch`` at the position, with ``steps`` batches left."""

    __reduce__ = _reduce

    epoch: int
    steps: int


@dataclass(frozen=True, slots=True)
class SamplesFailed:
    """The batch at ``step`` of ``epoch`` failed inside DALI or ``step``; run alone, these
    samples fail (``names``: their files, or ids). The worker exits right after sending it."""

    __reduce__ = _reduce

    epoch: int
    step: int
    ids: tuple[int, ...]
    names: tuple[str, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class WorkerFailure:
    """An exception inside the worker, with where it happened. The worker stops after sending."""

    __reduce__ = _reduce

    type_module: str
    type_name: str
    message: str
    traceback: str
    epoch: int | None
    step: int | None
    phase: str  # "source", "feeders", "step", "transport", ...


@dataclass(frozen=True, slots=True)
class WarningRelay:
    """A warning raised inside the worker, to be re-emitted in the trainer."""

    __reduce__ = _reduce

    category_module: str
    category_name: str
    message: str
    filename: str
    lineno: int


@dataclass(frozen=True, slots=True)
class LogRelay:
    """A log record from the worker, re-logged by the trainer's ``loader`` logger."""

    __reduce__ = _reduce

    level: int
    message: str


TrainerMessage = StartEpoch | AbortEpoch | Release | CudaFreeEvents | Seek | Shutdown
WorkerMessage = (
    Hello
    | ArenaReady
    | CudaRingReady
    | Signature
    | BatchReady
    | EpochEnd
    | EpochAborted
    | Sought
    | SamplesFailed
    | WorkerFailure
    | WarningRelay
    | LogRelay
)
