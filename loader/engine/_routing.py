"""Record routing: every record a worker sent goes to its session and the policy it concerns.
Runs in the trainer.

:class:`Router` drains one worker's control channel (one receive) and hands each record on: a
batch to the session's queue (and the order, and the time line), a region to the session's slot
reader, a signature or an epoch's end to the session and then to the signature agreement
(:mod:`loader.engine._agreement`), a lifecycle answer (Hello, EpochAborted, Sought) to the
session, failing samples to healing (the other workers are told), relayed warnings and logs to
the trainer's logging. It answers what a session returns through the roster.

It raises what a record reports (a relayed failure, a disagreement, a torn or unknown record);
the coordinator's wait fails the pool before the error leaves. Whether the channel reached its
end of stream the wait reads from the channel itself.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

from ipc import ChannelClosed, ProtocolError, open_region, wire

from . import _failures
from ._agreement import Agreement
from ._healing import Healing
from ._order import ArrivalOrder, InOrder
from ._roster import Roster
from ._session import WorkerSession
from ._stats import Timeline

logger = logging.getLogger("loader")


class Router:
    """Hands every record a worker sent to whoever it concerns."""

    def __init__(
        self,
        roster: Roster,
        healing: Healing,
        agreement: Agreement,
        order: InOrder | ArrivalOrder,
        timeline: Timeline,
        stream_of: Callable[[int], int] | None,
    ) -> None:
        """``stream_of(device_id)``: the trainer's current CUDA stream (GPU only)."""
        self._roster = roster
        self._healing = healing
        self._agreement = agreement
        self._order = order
        self._timeline = timeline
        self._stream_of = stream_of
        self._slots: dict[int, tuple[int, int]] = {}  # worker -> its CPU arena's slots, bytes each
        self._warned_memory = False

    def drain(self, session: WorkerSession) -> None:
        """Handle every record the worker sent so far (one receive)."""
        try:
            records = session.handle.channel.receive_ready()
        except ChannelClosed:  # this end was closed (the worker is being replaced)
            records = []
        session.heard(len(records))
        for record in records:
            self._dispatch(session, record)

    def _check_memory(self) -> None:
        """Warn once when the slots crowd a container's memory limit (the OOM killer's turn)."""
        if self._warned_memory:
            return
        text = _failures.memory_risk([(w, n, b) for w, (n, b) in sorted(self._slots.items())])
        if text is not None:
            self._warned_memory = True
            warnings.warn(text, RuntimeWarning, stacklevel=2)

    def _dispatch(self, session: WorkerSession, record: Any) -> None:
        if isinstance(record, wire.BatchReady):
            self._timeline.batch(session.index, session.epoch_step(record.step), record)
            if session.on_batch(record):
                self._order.arrived(session.index)
            else:  # a batch of an epoch the trainer left
                self._roster.release(session, record)
        elif isinstance(record, (wire.ArenaReady, wire.CudaRingReady)):
            session.attach(open_region(record, session.handle.channel, self._stream_of))
            if isinstance(record, wire.ArenaReady):
                self._slots[session.index] = (record.num_slots, record.slot_size)
                self._check_memory()
        elif isinstance(record, (wire.Signature, wire.EpochEnd)):
            if isinstance(record, wire.Signature):
                session.on_signature(record)
            else:
                session.on_epoch_end(record)
            self._agreement.check(self._roster.sessions)
        elif isinstance(record, wire.EpochAborted):
            session.on_aborted(record)
        elif isinstance(record, wire.Sought):
            session.on_sought(record)
        elif isinstance(record, wire.Hello):
            self._timeline.started(session.index, record)
            self._roster.send(session, session.on_hello(record))
        elif isinstance(record, wire.SamplesFailed):
            self._roster.tell_others(session, self._healing.samples_failed(session.view(), record))
        elif isinstance(record, wire.WorkerFailure):
            raise _failures.relayed(session.view(), record)
        elif isinstance(record, wire.WarningRelay):
            _failures.relay_warning(session.view(), record)
        elif isinstance(record, wire.LogRelay):
            logger.log(record.level, "worker %d: %s", session.index, record.message)
        elif isinstance(record, wire.Starting):
            session.on_starting(record)
        else:
            raise ProtocolError(
                f"{session.describe()} sent an unknown record {type(record).__name__}"
            )
