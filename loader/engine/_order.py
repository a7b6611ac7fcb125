"""Which worker the trainer serves next. Runs in the trainer.

Two orders, each a small object that looks at the sessions and answers with a decision; it never
waits, sends or raises (the coordinator acts on the answer):

* :class:`InOrder` (``in_order=True``, the default): round robin over workers from a cursor,
  skipping workers whose epoch is over and drained. The choice depends only on what each worker
  has delivered so far, never on timing, so the order of batches is the same on every run with
  the same seed.
* :class:`ArrivalOrder` (``in_order=False``): the batch that arrived first, from any worker.
  Exactly once as in order; only the interleaving differs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._session import WorkerSession


@dataclass(frozen=True, slots=True)
class Take:
    """Hand out the first queued batch of ``worker``."""

    worker: int


@dataclass(frozen=True, slots=True)
class Wait:
    """Nothing to take: wait for ``worker`` (the one a timeout names); ``blocked`` are the
    workers that may be out of slots, which the trainer may have to free first."""

    worker: int
    blocked: tuple[int, ...]


Decision = Take | Wait | None  # None: every worker's epoch is over and drained


def choose_worker(cursor: int, has_batch: Sequence[bool], running: Sequence[bool]) -> int | None:
    """Whose turn it is: from ``cursor`` on, round robin, the first worker that has a batch
    queued or may still send one; None when every worker's epoch is over and drained."""
    count = len(has_batch)
    for offset in range(count):
        index = (cursor + offset) % count
        if has_batch[index] or running[index]:
            return index
    return None


class InOrder:
    """Round robin from a cursor; the cursor moves past each worker served."""

    def __init__(self) -> None:
        self.cursor = 0

    def start(self, cursor: int) -> None:
        self.cursor = cursor

    def arrived(self, worker: int) -> None:
        """(Arrivals do not change the order.)"""

    def choose(self, sessions: Sequence[WorkerSession]) -> Decision:
        turn = sessions[self.cursor]
        if turn.queued:  # (the usual cases, decided without looking at the others)
            self.cursor = (self.cursor + 1) % len(sessions)
            return Take(turn.index)
        if turn.open_in_epoch:
            return Wait(turn.index, (turn.index,))
        index = choose_worker(
            self.cursor, [s.queued > 0 for s in sessions], [s.open_in_epoch for s in sessions]
        )
        if index is None:
            return None
        if sessions[index].queued:
            self.cursor = (index + 1) % len(sessions)
            return Take(index)
        return Wait(index, (index,))


class ArrivalOrder:
    """Workers in the order their batches arrived."""

    def __init__(self) -> None:
        self._arrivals: deque[int] = deque()

    def start(self, cursor: int) -> None:
        self._arrivals.clear()

    def arrived(self, worker: int) -> None:
        self._arrivals.append(worker)

    def choose(self, sessions: Sequence[WorkerSession]) -> Decision:
        arrivals = self._arrivals
        while arrivals:
            index = arrivals.popleft()
            if sessions[index].queued:  # (a replaced worker's queue was dropped)
                return Take(index)
        queued = [s.index for s in sessions if s.queued]
        if queued:  # never wait while a batch is queued (its worker may be out of slots)
            return Take(queued[0])
        open_sessions = [s for s in sessions if s.open_in_epoch]
        if not open_sessions:
            return None
        # waits on every worker; a timeout names the one that is furthest behind
        waiting = min(open_sessions, key=lambda s: s.next_step)
        return Wait(waiting.index, tuple(s.index for s in open_sessions))


Order = InOrder | ArrivalOrder
