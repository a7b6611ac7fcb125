"""The sessions of one layout's workers, and the one way records go to them. Runs in the trainer.

:class:`Roster` holds every worker's :class:`~loader.engine._session.WorkerSession`, in worker
order (made when the pool has started its processes), and sends to them: a command or an answer
a session returned, a record every other worker must hear, a slot released at once, and the
releases :class:`~loader.engine._releases.Releases` says are due. The coordinator, its wait
(:mod:`loader.engine._waiting`) and the router (:mod:`loader.engine._routing`) send through it;
nothing else writes to a worker's channel.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ipc import wire

from ..processes import WorkerHandle
from ._releases import Releases
from ._session import WorkerSession


class Roster:
    """Every worker's session, and the sends to them."""

    def __init__(self, releases: Releases) -> None:
        self.releases = releases
        self.sessions: list[WorkerSession] = []

    def open(self, handles: Sequence[WorkerHandle]) -> None:
        """One session per started process, in worker order."""
        self.sessions = [WorkerSession(handle) for handle in handles]

    def send(self, session: WorkerSession, record: Any) -> None:
        """Send ``record`` to ``session``'s worker (None: nothing to send)."""
        if record is not None:
            session.handle.send(record)

    def tell_others(self, session: WorkerSession, record: wire.BadSamples | None) -> None:
        """Send ``record`` to every worker but ``session``'s."""
        for other in self.sessions:
            if other is not session:
                self.send(other, record)

    def release(self, session: WorkerSession, descriptor: wire.BatchReady) -> None:
        """Give the slot of one batch of ``session``'s current process back now (a batch the
        trainer drops, or a private copy)."""
        self.send(session, self.releases.now(session.reader, descriptor))

    def send_releases(self, *, lazy: bool) -> None:
        """Send the queued releases that are due (see :meth:`Releases.due`)."""
        for worker, record in self.releases.due(self.sessions, lazy=lazy):
            self.sessions[worker].handle.send(record)
