"""A worker's session as the trainer sees it: what the worker is to do, its queue, its counters.

Runs in the trainer. The roster (:mod:`loader.engine._roster`) holds one :class:`WorkerSession`
per worker. A session holds one *target* -- what its worker is doing or, while a process starts,
will do once it said Hello (:class:`Idle`, :class:`Running`, :class:`Aborting`, :class:`Seeking`,
:class:`Stopped`) -- and whether its current process is up. Every change goes through
:meth:`WorkerSession.go` or :meth:`WorkerSession.replaced`, checked against the lifecycle table of
:class:`WorkerState`. The session handles its own worker's records (``on_*``); each returns the
record the engine must send, if any. It never sends, raises for a failure of the job, or closes
anything itself.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ipc import ProtocolError, ReaderRegion, SlotReader, wire
from ipc.wire import Position

from ..processes import WorkerHandle
from ._views import BatchInfo

if TYPE_CHECKING:
    from workers import Shard


class WorkerState(enum.IntEnum):
    """Where one worker is in its life, as the trainer knows it (derived from the session's
    target and whether its process said Hello).

    Legal transitions (anything else is a bug, and :meth:`WorkerSession.go` asserts it)::

        STARTING --Hello--> READY
        READY    --start_epoch(e)--> RUNNING(e)
        RUNNING  --EpochEnd(e)--> ENDED(e)            (queued batches may still wait)
        ENDED    --start_epoch(e+1)--> RUNNING(e+1)
        RUNNING | ENDED --abort_epoch(e)--> ABORTING(e)
        ABORTING --EpochAborted(e)--> READY            (sources rebuilt for the next epoch)
        READY | ENDED --seek(e)--> REBUILDING(e)       (load_state_dict: sources at a position)
        REBUILDING --Sought(e)--> READY
        any live --died or stuck, restart budget left--> STARTING (a new process)
        STARTING --a command--> STARTING               (the target changes; sent in order)
        STARTING --Hello--> RUNNING(e)                 (a replacement goes on with its epoch)
        STARTING --Hello--> ABORTING | REBUILDING      (a command it was sent is answered next)
        any      --failure, death, timeout--> FAILED
        any      --close--> CLOSED
    """

    STARTING = 0
    READY = 1
    RUNNING = 2
    ENDED = 3
    ABORTING = 4
    REBUILDING = 5
    FAILED = 6
    CLOSED = 7


_S = WorkerState
_LIVE = frozenset({_S.STARTING, _S.READY, _S.RUNNING, _S.ENDED, _S.ABORTING, _S.REBUILDING})
_LEGAL: dict[WorkerState, frozenset[WorkerState]] = {
    _S.STARTING: _LIVE,
    _S.READY: frozenset({_S.STARTING, _S.RUNNING, _S.REBUILDING}),
    _S.RUNNING: frozenset({_S.STARTING, _S.ENDED, _S.ABORTING}),
    _S.ENDED: frozenset({_S.STARTING, _S.RUNNING, _S.ABORTING, _S.REBUILDING}),
    _S.ABORTING: frozenset({_S.STARTING, _S.READY}),
    _S.REBUILDING: frozenset({_S.STARTING, _S.READY}),
    _S.FAILED: frozenset(),
    _S.CLOSED: frozenset(),
}


# ---------------------------------------------------------------------------------- targets
@dataclass(frozen=True, slots=True)
class Idle:
    """Waiting for commands, its sources built for ``epoch`` from ``position`` (None: the
    epoch's start; a position after ``load_state_dict``)."""

    epoch: int
    position: Position | None = None


@dataclass(frozen=True, slots=True)
class Running:
    """Running ``epoch``, which resumed from ``start`` (None: from its start). ``ended``: the
    worker sent the epoch's end (batches of it may still wait in the queue)."""

    epoch: int
    start: Position | None = None
    ended: bool = False


@dataclass(frozen=True, slots=True)
class Aborting:
    """Told to stop ``epoch`` and rebuild its sources for the next one."""

    epoch: int


@dataclass(frozen=True, slots=True)
class Seeking:
    """Rebuilding its sources to start ``position.epoch`` at ``position``. ``sent``: the process
    was sent a Seek and answers Sought (a replacement built at the position says Hello only)."""

    position: Position
    sent: bool = True


@dataclass(frozen=True, slots=True)
class Stopped:
    failed: bool


Target = Idle | Running | Aborting | Seeking | Stopped


@dataclass
class WorkerCounters:
    """What ``stats()`` reports of one worker (all counted in the trainer)."""

    steps: int = 0
    bytes: int = 0
    blocked_ns: int = 0
    busy_ns: int = 0
    traces: int = 0
    rebuilds: int = 0
    trace_seconds: list[float] = field(default_factory=list)
    restarts: int = 0
    #: what the worker's sources read (units, requests, bytes): the latest batch's report of
    #: its process, over ``reads_before`` (the processes it replaced)
    reads: tuple[int, int, int] = (0, 0, 0)
    reads_before: tuple[int, int, int] = (0, 0, 0)

    @property
    def total_reads(self) -> tuple[int, int, int]:
        a, b = self.reads, self.reads_before
        return (a[0] + b[0], a[1] + b[1], a[2] + b[2])


@dataclass(frozen=True, slots=True)
class Delivery:
    """One batch taken from a session: its record, arrays (views of the slot) and lease, and
    what ``batch.info`` says of it."""

    descriptor: wire.BatchReady
    arrays: list[Any]
    lease: Any
    info: BatchInfo
    reader: SlotReader


@dataclass(frozen=True, slots=True)
class SessionView:
    """One worker's session as the policies read it (healing, failures, stats): a snapshot that
    :meth:`WorkerSession.view` takes. The session owns its fields; a view changes nothing, and a
    test builds one directly (its ``handle`` only needs what the policy it tests calls)."""

    index: int
    shard: Shard
    handle: WorkerHandle  # the current process
    target: Target
    up: bool = True  # the current process said Hello
    epoch: int | None = None  # the epoch it runs, ended, aborted or resumed last
    queued: int = 0  # batches queued, not yet delivered
    hello: wire.Hello | None = None
    signature: wire.Signature | None = None
    signature_pending: bool = False
    received: int = 0  # batches of the epoch that arrived from this process
    delivered: int = 0  # batches of the epoch handed to the user (by every process)
    base_step: int = 0  # the epoch's step of the run's first batch (a resumed run: > 0)
    first_step: int = 0  # the epoch's step of this process's step 0
    resumed_steps: int | None = None  # batches left of a resumed epoch (Sought)
    random: wire.RandomStates = b""  # the states of the first batch not yet delivered
    last_step: int | None = None  # this process's step of the last batch it sent
    counters: WorkerCounters = field(default_factory=WorkerCounters)  # (a copy)
    slots_held: int = 0  # slots of the current process the trainer holds
    heard_at: float = 0.0  # when the current process last sent anything (or was started)
    starting: wire.Starting | None = None  # what it last said it does before its Hello

    def epoch_step(self, step: int) -> int:
        """The epoch's step of this process's ``step`` (see :meth:`WorkerSession.epoch_step`)."""
        return self.first_step + step

    def step_of(self, epoch: int | None, step: int) -> int:
        """The epoch's step of this process's ``step`` of ``epoch``: counted from the epoch's
        start for the epoch it runs, as it is for another (a batch prefetched across the
        epoch's end counts from 0)."""
        return self.epoch_step(step) if epoch == self.epoch else step

    @property
    def undelivered_step(self) -> int:
        """The epoch's step of the first batch not handed to the user."""
        return self.base_step + self.delivered

    def describe(self) -> str:
        return self.handle.describe()

    def doing(self) -> str:
        """What a starting process last said it does, and how long ago (for messages)."""
        if self.starting is None:
            return "it never said what it does (starting its process: spawn, imports)"
        ago = time.monotonic() - self.heard_at
        return f"it was last {self.starting.describe()} ({ago:.1f} s ago)"


class WorkerSession:
    """One worker: its target, process, queued batches and slots."""

    def __init__(self, handle: WorkerHandle) -> None:
        self._handle = handle
        self._index = handle.index
        self._shard = handle.shard
        self._target: Target = Idle(handle.shard.epoch)  # (a new layout starts at a later one)
        self._up = False  # the current process said Hello
        self._epoch: int | None = None  # the epoch it runs, ended, aborted or resumed last
        self._queue: deque[wire.BatchReady] = deque()
        self._reader = SlotReader(handle.spec.num_slots, handle.index)
        self._hello: wire.Hello | None = None
        self._signature: wire.Signature | None = None
        self._signature_pending = False  # a traced (or rebuilt) loop has yet to send one
        self._received = 0  # batches of the epoch that arrived from this process (queued or not)
        self._delivered = 0  # batches of the epoch handed to the user (by every process)
        self._base_step = 0  # the epoch's step of the run's first batch (a resumed run: > 0)
        self._first_step = 0  # the epoch's step of this process's step 0
        self._resumed_steps: int | None = None  # batches left of a resumed epoch (Sought)
        #: the random generator states of the first batch not yet delivered (those after the last
        #: delivered batch's step); empty: as the worker seeded them when it built its sources
        self._random: wire.RandomStates = b""
        self._random_before: wire.RandomStates = b""  # before the last handed_out (take_back)
        self._last_step: int | None = None
        self._counters = WorkerCounters()
        #: when the current process last sent anything (or was started): a starting worker is
        #: given ``startup_timeout`` from there (a long scan that reports progress is alive)
        self._heard_at = time.monotonic()
        #: what the current process last said it does before its Hello (None: nothing yet)
        self._starting: wire.Starting | None = None

    # ------------------------------------------------------------------------ state
    @property
    def state(self) -> WorkerState:
        return _state_of(self._target, self._up)

    def go(self, target: Target, *, up: bool | None = None) -> None:
        """Change the target (and whether the process is up), checked against the table."""
        up = self._up if up is None else up
        new = _state_of(target, up)
        assert (
            isinstance(target, Stopped)
            or new in _LEGAL[self.state]
            or (new == self.state == _S.STARTING)
        ), f"worker {self._index}: {self.state!r} -> {new!r}"
        self._target, self._up = target, up
        if isinstance(target, (Running, Aborting)):
            self._epoch = target.epoch
        elif isinstance(target, Seeking):
            self._epoch = target.position.epoch

    def drop_process(self) -> None:
        """Before a replacement: the old process's queued batches and slot regions go (the
        trainer's side of every region is closed before the worker that exports it dies)."""
        self._queue.clear()
        self._reader.close()

    def count_restart(self) -> None:
        """A replacement of this worker counts against ``max_restarts`` (``stats()`` shows it)."""
        self._counters.restarts += 1
        self._counters.reads_before = self._counters.total_reads
        self._counters.reads = (0, 0, 0)

    def close(self) -> None:
        """The pool closes: queued batches and slot regions go, a live worker is stopped."""
        self.drop_process()
        if not isinstance(self._target, Stopped):
            self.go(Stopped(failed=False))

    def replaced(self, handle: WorkerHandle, target: Target, first_step: int) -> None:
        """A new process for this worker, that does ``target`` once it said Hello."""
        self.go(target, up=False)
        self._handle = handle
        self._heard_at, self._starting = time.monotonic(), None
        self.drop_process()
        self._reader = SlotReader(handle.spec.num_slots, self._index)
        self._received = 0
        self._last_step = None
        self._first_step = first_step
        self._signature_pending = True

    @property
    def open_in_epoch(self) -> bool:
        """True while the worker may still send batches of its current epoch (a replacement
        that is starting to go on with the epoch counts)."""
        target = self._target
        return isinstance(target, Running) and not target.ended

    @property
    def next_epoch(self) -> int | None:
        """The epoch this worker starts at its next ``StartEpoch`` without a seek: the one after
        the epoch it runs, ended or aborts (a continuous capture loop has already begun it), or
        the one its sources are (being) built for; None once stopped."""
        target = self._target
        if isinstance(target, Idle):
            return target.epoch
        if isinstance(target, (Running, Aborting)):
            return target.epoch + 1
        if isinstance(target, Seeking):
            return target.position.epoch
        return None

    @property
    def next_step(self) -> int:
        """The step of the next batch the trainer expects from this process."""
        return self._received

    def epoch_step(self, step: int) -> int:
        """The epoch's step of this process's ``step`` (a replacement or a resumed run starts
        its count at 0; the user and every message count from the epoch's start)."""
        return self._first_step + step

    def describe(self) -> str:
        return self._handle.describe()

    # ------------------------------------------------------------------------ reads
    @property
    def index(self) -> int:
        return self._index

    @property
    def handle(self) -> WorkerHandle:
        """The current process (a replacement's once :meth:`replaced`)."""
        return self._handle

    @property
    def up(self) -> bool:
        """The current process said Hello."""
        return self._up

    @property
    def queued(self) -> int:
        """Batches queued and not yet delivered."""
        return len(self._queue)

    def peek(self) -> wire.BatchReady:
        """The first queued batch, left on the queue."""
        return self._queue[0]

    @property
    def reader(self) -> SlotReader:
        """The current process's slot reader."""
        return self._reader

    @property
    def hello(self) -> wire.Hello | None:
        return self._hello

    @property
    def signature(self) -> wire.Signature | None:
        return self._signature

    @property
    def signature_pending(self) -> bool:
        """A traced (or rebuilt) loop has yet to send its signature."""
        return self._signature_pending

    def view(self) -> SessionView:
        """A snapshot of the session, for the policies."""
        counters = self._counters
        return SessionView(
            self._index,
            self._shard,
            self._handle,
            self._target,
            self._up,
            self._epoch,
            len(self._queue),
            self._hello,
            self._signature,
            self._signature_pending,
            self._received,
            self._delivered,
            self._base_step,
            self._first_step,
            self._resumed_steps,
            self._random,
            self._last_step,
            replace(counters, trace_seconds=list(counters.trace_seconds)),
            self._reader.held,
            self._heard_at,
            self._starting,
        )

    # ------------------------------------------------------------------------ commands
    def start_epoch(self, epoch: int, base_step: int) -> wire.StartEpoch | None:
        """Run ``epoch`` (its first batch is the epoch's ``base_step``); a process still
        starting is told after its Hello."""
        target = self._target
        start = target.position if isinstance(target, Idle) and target.epoch == epoch else None
        self._received = self._delivered = 0
        self._base_step = self._first_step = base_step
        self._last_step = None
        self.go(Running(epoch, start))
        return wire.StartEpoch(epoch) if self._up else None

    def take_queued(self) -> list[wire.BatchReady]:
        """Every queued batch, taken off the queue (the trainer drops them: their slots go
        back)."""
        taken = list(self._queue)
        self._queue.clear()
        return taken

    def expect_signature(self) -> None:
        """The worker's sources are (being) rebuilt: its loop sends a signature again."""
        self._signature_pending = True

    def abort_epoch(self, epoch: int) -> wire.AbortEpoch:
        self.go(Aborting(epoch))
        self._random = b""  # the worker seeds its generators again for the next epoch
        return wire.AbortEpoch(epoch)

    def seek(self, position: Position, random: wire.RandomStates = b"") -> wire.Seek:
        """Sources at ``position``, the random generators in the states ``random`` (empty:
        seeded for that epoch)."""
        self._resumed_steps = None
        self._random = random
        self.go(Seeking(position))
        return wire.Seek(position, random)

    # ------------------------------------------------------------------------ records
    def heard(self, records: int) -> None:
        """``records`` arrived from the current process: it is alive now."""
        if records:
            self._heard_at = time.monotonic()

    def on_starting(self, message: wire.Starting) -> None:
        """What the process does before its Hello (named if it falls silent)."""
        self._starting = message

    def attach(self, region: ReaderRegion) -> None:
        """A slot region the current process made (an arena or a CUDA ring)."""
        self._reader.attach(region)

    def on_hello(self, message: wire.Hello) -> wire.StartEpoch | None:
        """The process is up: a replacement goes on with what its predecessor did."""
        self._hello = message
        target = self._target
        if isinstance(target, Seeking) and not target.sent:
            self._resumed_steps = message.first_epoch_steps
            target = Idle(target.position.epoch, target.position)
        self.go(target, up=True)
        return wire.StartEpoch(target.epoch) if isinstance(target, Running) else None

    def on_batch(self, message: wire.BatchReady) -> bool:
        """Queue a batch of the epoch in progress; False for one of an epoch the trainer left
        (to be released at once)."""
        try:
            self._reader.receive(message)
        except ProtocolError as error:
            raise ProtocolError(f"{self.describe()}: {error}") from None
        target = self._target
        if not (isinstance(target, Running) and not target.ended and message.epoch == target.epoch):
            return False
        if message.step != self._received:
            raise ProtocolError(
                f"{self.describe()} sent step {message.step} of epoch {message.epoch}, "
                f"expected step {self._received}"
            )
        self._queue.append(message)
        self._received += 1
        self._last_step = message.step
        counters = self._counters
        counters.steps += 1
        counters.bytes += message.nbytes
        counters.blocked_ns += message.blocked_ns
        counters.busy_ns += message.busy_ns
        counters.reads = message.reads
        return True

    def on_signature(self, message: wire.Signature) -> None:
        self._signature = message
        self._counters.trace_seconds.append(message.trace_seconds)
        self._signature_pending = False

    def on_epoch_end(self, message: wire.EpochEnd) -> None:
        target = self._target
        if isinstance(target, Running) and not target.ended and target.epoch == message.epoch:
            self.go(replace(target, ended=True))
        self._counters.traces = message.traces
        self._counters.rebuilds = message.rebuilds
        self._signature_pending = False  # an eager epoch after the first sends none

    def on_aborted(self, message: wire.EpochAborted) -> None:
        target = self._target
        if self._up and isinstance(target, Aborting) and target.epoch == message.epoch:
            self.go(Idle(message.epoch + 1))

    def on_sought(self, message: wire.Sought) -> None:
        target = self._target
        if self._up and isinstance(target, Seeking) and target.position.epoch == message.epoch:
            self._resumed_steps = message.steps
            self.go(Idle(message.epoch, target.position))

    # ------------------------------------------------------------------------ delivery
    def deliver(self, step: int) -> Delivery:
        """The next queued batch, as views of its slot, with its ``batch.info``: the rank's
        ``step`` of the epoch. It counts as delivered once it reached the user
        (:meth:`handed_out`)."""
        descriptor = self._queue.popleft()
        info = BatchInfo(
            epoch=descriptor.epoch,
            step=step,
            worker=self._index,
            worker_step=self.epoch_step(descriptor.step),
            shard=self._shard.index,
            padded=descriptor.padded,
            replaced=descriptor.replaced,
            skipped=descriptor.skipped,
            skipped_names=descriptor.skipped_names,
        )
        arrays, lease = self._reader.arrays(descriptor)
        return Delivery(descriptor, arrays, lease, info, self._reader)

    def handed_out(self, descriptor: wire.BatchReady) -> None:
        """``descriptor``'s batch (the last delivered) reached the user: one more delivered,
        and the random generator states are those of the batch after it."""
        self._random_before = self._random
        self._delivered += 1
        if descriptor.random:
            self._random = descriptor.random

    def take_back(self, descriptor: wire.BatchReady) -> None:
        """``descriptor``'s batch did not reach the user after all (an interruption): not
        counted, if :meth:`handed_out` had counted it (told by its step: the first batch not
        delivered is the epoch's ``base_step + delivered``)."""
        if self._base_step + self._delivered > self.epoch_step(descriptor.step):
            self._delivered -= 1
            self._random = self._random_before


def _state_of(target: Target, up: bool) -> WorkerState:
    if isinstance(target, Stopped):
        return _S.FAILED if target.failed else _S.CLOSED
    if not up:
        return _S.STARTING
    if isinstance(target, Idle):
        return _S.READY
    if isinstance(target, Running):
        return _S.ENDED if target.ended else _S.RUNNING
    if isinstance(target, Aborting):
        return _S.ABORTING
    return _S.REBUILDING
