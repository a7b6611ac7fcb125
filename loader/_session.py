"""A worker's session as the trainer sees it: its lifecycle, its queue, its counters.

Runs in the trainer. The coordinator owns one :class:`WorkerSession` per worker and is the only
code that changes its state, through its methods; everything else reads.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from ipc import SlotReader, wire
from workers import Position

from ._pool import WorkerHandle


class WorkerState(enum.IntEnum):
    """Where one worker is in its life, as the trainer knows it.

    Legal transitions (anything else is a bug, and :meth:`WorkerSession.move` asserts it)::

        STARTING --Hello--> READY
        READY    --start_epoch(e)--> RUNNING(e)
        RUNNING  --EpochEnd(e)--> ENDED(e)            (queued batches may still wait)
        ENDED    --start_epoch(e+1)--> RUNNING(e+1)
        RUNNING | ENDED --abort_epoch(e)--> ABORTING(e)
        ABORTING --EpochAborted(e)--> READY            (sources rebuilt for the next epoch)
        READY | ENDED --seek(e)--> REBUILDING(e)       (load_state_dict: sources at a position)
        REBUILDING --Sought(e)--> READY
        any but FAILED, CLOSED --died or stuck, restart budget left--> STARTING (a new process)
        STARTING --Hello--> RUNNING(e)                 (a replacement goes on with its epoch)
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


_LEGAL: dict[WorkerState, frozenset[WorkerState]] = {
    WorkerState.STARTING: frozenset({WorkerState.READY, WorkerState.RUNNING}),
    WorkerState.READY: frozenset({WorkerState.RUNNING, WorkerState.REBUILDING}),
    WorkerState.RUNNING: frozenset({WorkerState.ENDED, WorkerState.ABORTING}),
    WorkerState.ENDED: frozenset(
        {WorkerState.RUNNING, WorkerState.ABORTING, WorkerState.REBUILDING}
    ),
    WorkerState.ABORTING: frozenset({WorkerState.READY}),
    WorkerState.REBUILDING: frozenset({WorkerState.READY}),
    WorkerState.FAILED: frozenset(),
    WorkerState.CLOSED: frozenset(),
}


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


class WorkerSession:
    """One worker's lifecycle, queued batches and slots, owned by the coordinator."""

    def __init__(self, handle: WorkerHandle) -> None:
        self.handle = handle
        self.index = handle.index
        self.shard = handle.shard
        self.state = WorkerState.STARTING
        self.epoch: int | None = None  # the epoch RUNNING, ENDED or ABORTING refers to
        self.queue: deque[wire.BatchReady] = deque()
        self.reader = SlotReader(handle.spec.num_slots, handle.index)
        self.hello: wire.Hello | None = None
        self.signature: wire.Signature | None = None
        self.signature_pending = False  # a traced (or rebuilt) loop has yet to send one
        self.received = 0  # batches of ``epoch`` that arrived from this worker (queued or not)
        self.delivered = 0  # batches of ``epoch`` handed to the user
        self.step_offset = 0  # a replacement's step 0 is this step of the run
        self.base_step = 0  # a resumed run's step 0 is this step of the epoch
        self.exit_expected = False  # the worker said it exits (SamplesFailed)
        self.resumed_steps: int | None = None  # batches of a resumed epoch (after Sought)
        self.last_step: int | None = None
        self.counters = WorkerCounters()
        #: what the current process's sources are built for: (epoch, position)
        self.sources_for: tuple[int, Position | None] = (0, None)
        #: what a replacement process does once it said Hello: (state, epoch)
        self.after_start: tuple[WorkerState, int | None] = (WorkerState.READY, None)

    def move(self, state: WorkerState, epoch: int | None = None) -> None:
        if state == WorkerState.STARTING and self.state not in (
            WorkerState.FAILED,
            WorkerState.CLOSED,
        ):
            pass  # a replacement process, from any live state
        elif state not in (WorkerState.FAILED, WorkerState.CLOSED):
            assert state in _LEGAL[self.state], f"worker {self.index}: {self.state!r} -> {state!r}"
        self.state = state
        if epoch is not None:
            self.epoch = epoch

    @property
    def open_in_epoch(self) -> bool:
        """True while the worker may still send batches of its current epoch (a replacement
        that is starting to go on with the epoch counts)."""
        return self.state == WorkerState.RUNNING or (
            self.state == WorkerState.STARTING and self.after_start[0] == WorkerState.RUNNING
        )

    @property
    def next_step(self) -> int:
        """The step of the next batch the trainer expects from this process."""
        return self.received

    def epoch_step(self, step: int) -> int:
        """The epoch's step of this process's ``step`` (a replacement or a resumed run starts
        its count at 0; the user and every message count from the epoch's start)."""
        return self.base_step + self.step_offset + step

    def describe(self) -> str:
        return self.handle.describe()


def choose_worker(cursor: int, has_batch: Sequence[bool], running: Sequence[bool]) -> int | None:
    """Whose turn it is: from ``cursor`` on, round robin, the first worker that has a batch
    queued or may still send one; None when every worker's epoch is over and drained.

    The choice depends only on what each worker has *delivered so far*, never on timing, so
    the order of batches is the same on every run with the same seed.
    """
    count = len(has_batch)
    for offset in range(count):
        index = (cursor + offset) % count
        if has_batch[index] or running[index]:
            return index
    return None
