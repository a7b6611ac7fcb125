"""Whether every worker traced the same loop. Runs in the trainer.

Each worker's loop sends a :class:`~ipc.wire.Signature` once traced (again after its sources were
rebuilt, and from a replacement process). :class:`Agreement` knows when a round of signatures is
due (after the start, an abort or a seek: :meth:`Agreement.expect`; after a replacement:
:meth:`Agreement.reopen`), checks the round once every pending signature arrived
(:func:`loader.engine._failures.disagreement`), keeps the *reference* signature every worker
agrees on, and warns of a fallback once. It raises a disagreement; the coordinator's wait fails
the pool before the error leaves.
"""

from __future__ import annotations

from collections.abc import Sequence

from ipc import wire

from . import _failures
from ._session import WorkerSession


class Agreement:
    """The signature every worker agrees on, and whether a round is still to be checked."""

    def __init__(self) -> None:
        self.reference: wire.Signature | None = None  # the signature every worker agrees on
        self._due = False
        self._fallback_warned = False

    def expect(self, sessions: Sequence[WorkerSession]) -> None:
        """Every worker rebuilt (or built) its sources: each sends its signature again."""
        for session in sessions:
            session.expect_signature()
        self._due = True

    def reopen(self) -> None:
        """A worker was replaced: the round is checked again once its signature arrived."""
        self._due = True

    def check(self, sessions: Sequence[WorkerSession]) -> None:
        """Once every pending signature arrived: every worker traced the same loop (raises
        what differs)."""
        if not self._due or any(s.signature_pending for s in sessions):
            return
        self._due = False
        error, fell_back = _failures.disagreement([s.view() for s in sessions])
        if error is not None:
            raise error
        self.reference = next((s.signature for s in sessions if s.signature), None)
        if fell_back and not self._fallback_warned:
            self._fallback_warned = True
            _failures.warn_fallback(fell_back)
