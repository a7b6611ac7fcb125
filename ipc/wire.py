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
* :class:`Seek` -- rebuild the sources for an epoch resumed from a saved position (and, on the
  same layout, the random generator states of its first batch).
* :class:`BadSamples` -- on_error="skip": samples another worker found failing; replace them too.
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
* :class:`SamplesFailed` -- on_error="skip": these samples broke a batch inside DALI (the worker
  exits after it and the trainer starts a new one at that batch, without them), or their
  ``load`` raised (the worker goes on, ``exits=False``).
* :class:`WarningRelay`, :class:`LogRelay` -- a warning or log record to re-emit in the trainer.

Each record travels in one frame (:data:`FRAME`: payload length, kind). The two records every
batch costs, :class:`BatchReady` and :class:`Release`, have fixed binary layouts (see
:class:`BatchCodec`); every other record is pickled.

A batch carries the worker's random generator states after its step (:data:`RandomStates`), which
are the states of the worker's next batch: what a resume or a replacement restores so that the
batches after it are byte-identical.

A record that breaks this contract (an unknown kind, a slot or arena that does not exist, a
placement outside its slot, a duplicated fill) raises :class:`ProtocolError` on the receiving side.

Besides the channel, a worker's stack pipe carries faulthandler's text, and, when the trainer asks
for the stack (``signals.STACK_SIGNAL``) while a sample's ``load`` runs, one :class:`LoadRunning`
line after it.
"""

from __future__ import annotations

import json
import pickle
import re
import struct
from collections import namedtuple
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, Any, ClassVar

Shape = tuple[int, ...]


class ProtocolError(RuntimeError):
    """A peer sent something the wire contract does not allow."""


def _reduce(record: Any) -> tuple[Any, tuple[Any, ...]]:
    """Pickle a slotted record as its class and field values (much faster than the default)."""
    return type(record), tuple(getattr(record, name) for name in record.__slots__)


# --------------------------------------------------------------------------- shared values
@dataclass(frozen=True, slots=True)
class Sampling:
    """What decides an epoch's samples for a ``sharded_source``/``sharded_files`` root: the same
    on every rank, worker and run. ``Hello`` carries it; the trainer checks and saves it.

    ``fingerprint``: what the source reads, so that a state is not resumed over other data:
    ``files:<hash>`` of ``sharded_files``'s list of files, or the ``fingerprint=`` given to
    ``sharded_source`` (empty: none). ``parts``: what the data is part by part (shards, class
    folders: ``workers.sources.plan._parts``), kept in a state so that a refused one names what
    differs (empty: not known)."""

    __reduce__ = _reduce

    total: int
    batch_size: int
    seed: int
    shuffle: bool
    drop_last: bool
    fingerprint: str = ""
    parts: str = ""


@dataclass(frozen=True, slots=True)
class Position:
    """Where epoch ``epoch`` stands: ``segments`` of ``(ranks, batches received per shard)``,
    oldest first (each a layout a run used: its world size, and one count per shard of its
    ``ranks * num_workers``). ``Seek`` carries it.

    ``continues``: the run that uses this position has the layout of the last segment (same
    world size and workers), so each shard goes on with its own batches; otherwise the samples
    not yet received are split among the new shards.
    """

    __reduce__ = _reduce

    epoch: int
    segments: tuple[tuple[int, tuple[int, ...]], ...]
    continues: bool = False

    def __post_init__(self) -> None:
        for ranks, received in self.segments:
            if ranks < 1 or not received or len(received) % ranks or any(r < 0 for r in received):
                raise ValueError(
                    f"a position segment needs counts >= 0 for a whole number of shards per "
                    f"rank on {ranks} rank(s), got {received}"
                )


#: A worker's DALI random generators, as a batch, a Seek or a worker's spec carries them: each
#: generator's state as DALI writes it (``str(rng.get_state())``), ASCII, separated by one space,
#: the worker's default generator first. Empty: as the worker seeded them when it built its
#: sources (nothing drew since), from the loader's seed, the shard and the epoch.
RandomStates = bytes


def join_states(states: list[str]) -> RandomStates:
    """:data:`RandomStates` from generator states (raises ``ValueError`` for a state that is not
    one ASCII word)."""
    for state in states:
        if not state.isascii() or len(state.split()) != 1 or state.strip() != state:
            raise ValueError(f"{state!r} is not a random generator state")
    return " ".join(states).encode("ascii")


def split_states(data: RandomStates) -> list[str]:
    """The generator states in ``data`` (none when it is empty)."""
    return data.decode("ascii").split(" ") if data else []


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
    """Rebuild the sources to start ``position.epoch`` at ``position``, their random generators
    at ``random`` (empty: seeded as for a fresh start of that epoch)."""

    __reduce__ = _reduce

    position: Position
    random: RandomStates = b""


@dataclass(frozen=True, slots=True)
class BadSamples:
    """on_error="skip": sample ids another worker reported failing (``SamplesFailed``); this
    worker replaces them from its next load on instead of failing on them itself."""

    __reduce__ = _reduce

    ids: tuple[int, ...]


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
    #: a sharded_source/sharded_files root's sampling, whose position the loader can save and
    #: resume; None for any other source
    sampling: Sampling | None = None
    #: batches of the epoch the sources were built for (fewer when started mid-epoch)
    first_epoch_steps: int | None = None
    #: what the source leaves out of every epoch, one line each (a damaged tar shard under
    #: on_error="skip": its name, what is wrong, what of it is read)
    left_out: tuple[str, ...] = ()
    #: where the start went: ``(name, begin_ns, end_ns, pid)`` (``time.perf_counter_ns``), the
    #: worker's own spans (its pid) and those of the server it was forked from (workers.startup)
    startup: tuple[tuple[str, int, int, int], ...] = ()


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


#: A worker's stages, in the order a batch goes through them, as its main thread sees them:
#: ``load`` waiting for the source's samples (a ``sharded_source``/``sharded_files`` root: its
#: prefetch thread's ``load``), ``dali`` running DALI (the pipeline's outputs, ``step``),
#: ``blocked`` waiting for a free slot, ``publish`` copying into the slot, ``idle`` waiting for a
#: command (between epochs) since the previous batch. The one list of them: a batch's
#: :class:`StageTimes` and its wire format (:data:`TIMING`), the trainer's running totals and
#: windows, and ``loader.stats()``'s ``Stages`` are made from it (and :data:`MEASURES`).
STAGES = ("load", "dali", "blocked", "publish", "idle")
#: The other times of a batch, beside the stages (they overlap them), since the previous batch:
#: ``read`` and ``read_cpu`` the prefetch thread's wall and CPU time in ``load``, ``cpu`` the
#: process's CPU time (every thread).
MEASURES = ("read", "read_cpu", "cpu")
#: The stages that a batch's time line lays before its ``started_ns``; the others follow it, in
#: :data:`STAGES` order, and the batch is in its slot when they end.
BEFORE_START = ("idle",)
#: The stages a :class:`BatchReady` carries in a field of its own (``<stage>_ns``), not in its
#: :class:`StageTimes`.
IN_BATCH = ("blocked",)
#: :class:`StageTimes`'s fields, in order: ``started_ns``, then ``<name>_ns`` of each stage (but
#: those of :data:`IN_BATCH`) and each measure.
TIME_FIELDS = ("started_ns", *(f"{n}_ns" for n in (*STAGES, *MEASURES) if n not in IN_BATCH))

_STAGE_TIMES_DOC = """Where a worker's time went around one batch, in nanoseconds, as its main
thread saw it: a named tuple of :data:`TIME_FIELDS` (made from :data:`STAGES` and
:data:`MEASURES`), every field 0 by default.

``started_ns`` is ``time.perf_counter_ns()`` when the batch's step began: on Linux that clock is
``CLOCK_MONOTONIC``, the same in every process of the machine, so a trainer can lay the spans of
its workers on one time line. In order from ``started_ns``: ``load_ns``, ``dali_ns``, then the
batch's ``blocked_ns`` (in its ``BatchReady``) and ``publish_ns``; ``idle_ns`` lies before
``started_ns``. ``read_ns``, ``read_cpu_ns`` and ``cpu_ns``: the measures (see :data:`MEASURES`).
(A named tuple: it is made and read on every batch, at a fraction of a dataclass's cost.)"""

if TYPE_CHECKING:

    class StageTimes(tuple[int, ...]):
        """What type checkers see of the named tuple made below from :data:`TIME_FIELDS`."""

        _fields: ClassVar[tuple[str, ...]]

        def __new__(cls, *times: int, **named: int) -> StageTimes: ...

        @classmethod
        def _make(cls, iterable: Iterable[int]) -> StageTimes: ...

        def _asdict(self) -> dict[str, int]: ...

        def __getattr__(self, name: str) -> int: ...

else:
    StageTimes = namedtuple(
        "StageTimes", TIME_FIELDS, defaults=(0,) * len(TIME_FIELDS), module=__name__
    )
    StageTimes.__doc__ = _STAGE_TIMES_DOC


NO_STAGE_TIMES = StageTimes()


@dataclass(frozen=True, slots=True)
class BatchReady:
    """A filled slot. ``generation`` counts the fills of that slot; a release must quote it.
    ``random``: the worker's random generator states after this batch's step, which are those of
    its next batch (empty: unchanged since the worker built its sources)."""

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
    random: RandomStates = b""
    timing: StageTimes = NO_STAGE_TIMES  # where the worker's time went around this batch
    #: (member, rows) of the optional members this batch's real rows hold the default of
    defaulted: tuple[tuple[str, int], ...] = ()
    #: what the worker's sources have read since it started: (units -- Parquet row groups --,
    #: ranged requests, bytes)
    reads: tuple[int, int, int] = (0, 0, 0)


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


#: The kinds of failure that skip a sample (``SamplesFailed.kind``), in the order the
#: skip-limit error names them: a required member or column value missing, an image that does
#: not decode (or is too large to), an exception in ``step`` on the sample alone, a ``load``
#: that raised (or hung) otherwise.
MEMBER_MISSING = "member missing"
UNDECODABLE = "file undecodable"
IN_STEP = "exception in step"
LOAD_FAILED = "load failed"
SKIP_KINDS = (MEMBER_MISSING, UNDECODABLE, IN_STEP, LOAD_FAILED)


@dataclass(frozen=True, slots=True)
class SamplesFailed:
    """The batch at ``step`` of ``epoch`` failed inside DALI or ``step``; run alone, these
    samples fail (``names``: their files, or ids). The worker exits right after sending it.
    With ``exits=False`` their ``load`` raised: the batch was made without them (their rows
    replaced) and the worker goes on; the trainer logs them and tells the other workers.
    ``kind``: one of :data:`SKIP_KINDS`, said where the failure was caught; ``member``: the
    member (or column) missing, for :data:`MEMBER_MISSING`; ``left_out``: for a sample of a
    shard found cut short since it was indexed (data known lost, not a bad sample), the
    shard's line for ``stats().left_out``."""

    __reduce__ = _reduce

    epoch: int
    step: int
    ids: tuple[int, ...]
    names: tuple[str, ...]
    reason: str
    exits: bool = True
    kind: str = LOAD_FAILED
    member: str = ""
    left_out: str = ""


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


@dataclass(frozen=True, slots=True)
class Starting:
    """What a worker does before its Hello: sent at each phase of its start and, while its
    source indexes data that has none (a scan of tar shards), about every second. The trainer's
    startup wait counts a worker that sends records as alive (``startup_timeout`` runs from the
    last one), and names the last of these when a worker falls silent."""

    __reduce__ = _reduce

    phase: str  # the worker's phase (``workers.Phase``): "startup", "source", "feeders"
    doing: str  # in words: "calling source(shard)", "indexing 10000 tar shards ..."
    done: int = 0  # of ``total`` (0 of 0: nothing counted)
    total: int = 0
    seconds: float = 0.0  # since what it counts began

    def describe(self) -> str:
        """``doing``, with the count when there is one: ``indexing ...: 123 of 10,000, 41 s``."""
        if not self.total:
            return self.doing
        return f"{self.doing}: {self.done:,} of {self.total:,} done, {self.seconds:.0f} s"


TrainerMessage = StartEpoch | AbortEpoch | Release | CudaFreeEvents | Seek | BadSamples | Shutdown
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
    | Starting
)


# --------------------------------------------------------------------------- stack pipe
@dataclass(frozen=True, slots=True)
class LoadRunning:
    """A sample's ``load`` running in the worker when the trainer asked for its stack: the
    worker writes :meth:`line` to its stack pipe after faulthandler's dump, the trainer finds
    it in what it read with :meth:`find` (a load stuck for long is the sample that hangs)."""

    index: int
    seconds: float  # how long this load has been running
    name: str  # the sample's file for sharded_files, else its id
    epoch: int  # the batch it is loaded for: its epoch, and its step in this process's count
    step: int

    def line(self) -> str:
        return (
            f"--- load() of sample {self.index} running for {self.seconds:.1f} s (epoch "
            f"{self.epoch}, this process's step {self.step}): {json.dumps(self.name)} ---\n"
        )

    @classmethod
    def find(cls, text: str) -> LoadRunning | None:
        """The last such line in ``text`` (a stack dump), or None."""
        found = None
        for match in _LOAD_RUNNING.finditer(text):
            found = match
        if found is None:
            return None
        index, seconds, epoch, step, name = found.groups()
        try:
            return cls(int(index), float(seconds), str(json.loads(name)), int(epoch), int(step))
        except ValueError:
            return None


_LOAD_RUNNING = re.compile(
    r"^--- load\(\) of sample (\d+) running for ([0-9.]+) s "
    r"\(epoch (-?\d+), this process's step (-?\d+)\): (\".*\") ---$",
    re.M,
)


# --------------------------------------------------------------------------- framing
#: Every frame: ``<u32 payload length><u8 kind>``, then the payload.
FRAME = struct.Struct("<IB")
FRAME_PICKLED = 0  #: payload: a pickled record
#: payload: ``_BATCH``, ``TIMING``, the output layout (:meth:`BatchCodec.encode_layout`), the
#: random states
FRAME_BATCH = 1
FRAME_RELEASE = 2  #: payload: ``(slot, generation)`` pairs as little-endian int64

#: epoch, step, arena_id, slot, generation, nbytes, padded, blocked_ns, busy_ns, the reads (units,
#: requests, bytes), layout bytes, random state bytes
_BATCH = struct.Struct("<qqiiqqiqqqqqIH")
#: a batch's StageTimes, its fields in order (an int64 each)
TIMING = struct.Struct(f"<{len(TIME_FIELDS)}q")
#: per output: offset, nbytes, dense, ndim, samples, then the byte lengths of name, dtype, layout
_OUTPUT = struct.Struct("<qqBBIHHH")
#: layouts a codec remembers (a ragged output makes a new one per batch; the cache then resets)
_LAYOUT_CACHE = 256


class BatchCodec:
    """Encodes and decodes frames; one per channel end.

    A batch's output layout (names, dtypes, offsets, shapes) repeats from batch to batch for a
    fixed-shape step, so both sides cache it: the worker encodes a layout once, the trainer
    decodes a layout's bytes once and hands out the same placements again.
    """

    __slots__ = ("_decoded", "_encoded")

    def __init__(self) -> None:
        self._encoded: dict[tuple[OutputPlacement, ...], bytes] = {}
        self._decoded: dict[bytes, tuple[OutputPlacement, ...]] = {}

    def encode(self, message: Any) -> bytes:
        """One frame holding ``message``."""
        if (
            type(message) is BatchReady
            and not message.replaced
            and not message.skipped
            and not message.defaulted
        ):
            layout = self.encode_layout(message.outputs)
            random = message.random
            if layout is not None and len(random) <= 0xFFFF:
                head = _BATCH.pack(
                    message.epoch,
                    message.step,
                    message.arena_id,
                    message.slot,
                    message.generation,
                    message.nbytes,
                    message.padded,
                    message.blocked_ns,
                    message.busy_ns,
                    *message.reads,
                    len(layout),
                    len(random),
                )
                timing = TIMING.pack(*message.timing)
                size = len(head) + len(timing) + len(layout) + len(random)
                return FRAME.pack(size, FRAME_BATCH) + head + timing + layout + random
        elif type(message) is Release:
            flat = list(chain.from_iterable(message.fills))
            payload = struct.pack(f"<{len(flat)}q", *flat)
            return FRAME.pack(len(payload), FRAME_RELEASE) + payload
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        return FRAME.pack(len(payload), FRAME_PICKLED) + payload

    def decode(self, kind: int, buffer: bytes | bytearray, start: int, end: int) -> Any:
        """The record of a binary frame whose payload is ``buffer[start:end]``."""
        try:
            if kind == FRAME_BATCH:
                (
                    epoch,
                    step,
                    arena,
                    slot,
                    generation,
                    nbytes,
                    padded,
                    blocked,
                    busy,
                    units,
                    requests,
                    read_bytes,
                    size,
                    extra,
                ) = _BATCH.unpack_from(buffer, start)
                timing = StageTimes._make(TIMING.unpack_from(buffer, start + _BATCH.size))
                layout_start = start + _BATCH.size + TIMING.size
                layout_end = layout_start + size
                if layout_end + extra != end:
                    raise ProtocolError("a batch frame's layout does not fill its frame")
                outputs = self.decode_layout(bytes(buffer[layout_start:layout_end]))
                random = bytes(buffer[layout_end:end]) if extra else b""
                return BatchReady(
                    epoch,
                    step,
                    arena,
                    slot,
                    generation,
                    outputs,
                    nbytes,
                    padded,
                    blocked,
                    busy,
                    random=random,
                    timing=timing,
                    reads=(units, requests, read_bytes),
                )
            if kind == FRAME_RELEASE:
                count = (end - start) // 8
                if count % 2 or count * 8 != end - start:
                    raise ProtocolError("a release frame is not a list of (slot, generation)")
                flat = struct.unpack_from(f"<{count}q", buffer, start)
                return Release(tuple(zip(flat[::2], flat[1::2], strict=True)))
        except struct.error as error:
            raise ProtocolError(f"a torn binary frame: {error}") from None
        raise ProtocolError(f"an unknown frame kind {kind}")

    def encode_layout(self, outputs: tuple[OutputPlacement, ...]) -> bytes | None:
        """The binary layout of ``outputs``, or None when it has none (samples of different
        ranks, or a string too long for its length field): such a batch goes pickled."""
        layout = self._encoded.get(outputs)
        if layout is not None:
            return layout
        parts = []
        for placement in outputs:
            shapes = placement.shapes
            ndim = len(shapes[0]) if shapes else 0
            if ndim > 255 or any(len(shape) != ndim for shape in shapes):
                return None
            texts = [text.encode() for text in (placement.name, placement.dtype, placement.layout)]
            if any(len(text) > 0xFFFF for text in texts):
                return None
            dims = list(chain.from_iterable(shapes[:1] if placement.dense else shapes))
            parts.append(
                _OUTPUT.pack(
                    placement.offset,
                    placement.nbytes,
                    placement.dense,
                    ndim,
                    len(shapes),
                    *(len(text) for text in texts),
                )
            )
            parts.extend(texts)
            parts.append(struct.pack(f"<{len(dims)}q", *dims))
        layout = b"".join(parts)
        if len(self._encoded) >= _LAYOUT_CACHE:
            self._encoded.clear()
        self._encoded[outputs] = layout
        return layout

    def decode_layout(self, layout: bytes) -> tuple[OutputPlacement, ...]:
        """The placements of a binary layout (the same tuple again for the same bytes)."""
        outputs = self._decoded.get(layout)
        if outputs is not None:
            return outputs
        try:
            outputs = self._parse_layout(layout)
        except struct.error as error:
            raise ProtocolError(f"a batch layout is torn: {error}") from None
        if len(self._decoded) >= _LAYOUT_CACHE:
            self._decoded.clear()
        self._decoded[layout] = outputs
        return outputs

    @staticmethod
    def _parse_layout(layout: bytes) -> tuple[OutputPlacement, ...]:
        placements = []
        position = 0
        while position < len(layout):
            offset, nbytes, dense, ndim, count, *lengths = _OUTPUT.unpack_from(layout, position)
            position += _OUTPUT.size
            texts = []
            for length in lengths:
                try:
                    texts.append(layout[position : position + length].decode())
                except UnicodeDecodeError as error:
                    raise ProtocolError(f"a batch layout holds a bad name: {error}") from None
                position += length
            rows = (1 if count else 0) if dense else count
            dims = struct.unpack_from(f"<{rows * ndim}q", layout, position)
            position += 8 * rows * ndim
            shapes = tuple(tuple(dims[i * ndim : (i + 1) * ndim]) for i in range(rows))
            if dense:
                shapes = shapes * count
            placements.append(
                OutputPlacement(texts[0], texts[1], offset, nbytes, shapes, bool(dense), texts[2])
            )
        if position != len(layout):
            raise ProtocolError("a batch layout is torn")
        return tuple(placements)
