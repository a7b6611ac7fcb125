"""When a batch's slot goes back to its worker. Runs in the trainer.

A delivered batch's views keep its slot; when the last of them is collected, a finalizer queues
the slot's release in the :class:`~loader.engine._release_queue.ReleaseQueue` (the mechanism:
any thread fills it). :class:`Releases` is the policy: which queued releases to send and when,
one record per worker, batched by half a ring while that costs the worker nothing, and at once
for ``copy=True`` (the batch is a private copy). It returns records; the roster
(:mod:`loader.engine._roster`) sends them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ipc import SlotReader, wire

from ._release_queue import ReleaseQueue

if TYPE_CHECKING:
    from ._session import WorkerSession


class Releases:
    """The release queue and the rule that batches what it sends."""

    def __init__(self) -> None:
        self.queue = ReleaseQueue()
        #: releases not sent yet, per slot reader (a replaced process's reader is dropped)
        self._pending: dict[SlotReader, list[tuple[int, int]]] = {}

    def due(
        self, sessions: Sequence[WorkerSession], *, lazy: bool
    ) -> list[tuple[int, wire.Release]]:
        """Queued releases to send now, as ``(worker, record)``, one record per worker.

        ``lazy`` keeps fewer than half a ring of a worker's releases queued while that costs
        nothing: the worker still has a free slot (or a batch on its way), or the trainer still
        holds a batch of it to deliver next. A busy trainer then wakes a blocked worker once per
        half ring rather than once per batch, and a starved one gets one release record per
        half ring (fewer, larger records both ways). A release a worker needs to go on is never
        held back, so waiting on a worker cannot deadlock."""
        pending = self._pending
        if not pending and not self.queue:
            return []
        for reader, slot, generation in self.queue.take():
            if sessions[reader.owner].reader is not reader:
                continue  # a fill of a replaced process: its slots went with it
            if reader.release(slot, generation):
                pending.setdefault(reader, []).append((slot, generation))
        records = []
        for reader in list(pending):
            session = sessions[reader.owner]
            fills = pending[reader]
            if session.reader is not reader:
                del pending[reader]  # the process was replaced: its slots went with it
                continue
            if (
                lazy
                and len(fills) < max(1, reader.num_slots // 2)
                and (session.queued or reader.held + len(fills) < reader.num_slots)
            ):
                continue
            del pending[reader]
            records.append((reader.owner, wire.Release(tuple(fills))))
        return records

    @staticmethod
    def now(reader: SlotReader, descriptor: wire.BatchReady) -> wire.Release | None:
        """The release of one fill, sent at once (a batch the trainer drops, or a private copy
        under ``copy=True``); None when it was released already."""
        if reader.release(descriptor.slot, descriptor.generation):
            return wire.Release(((descriptor.slot, descriptor.generation),))
        return None

    def close(self) -> None:
        self.queue.close()
