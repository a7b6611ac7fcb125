"""What a worker is doing, named in every error it reports. Runs in the worker.

:class:`Phase` is the activity of the moment; :class:`Activity` is the worker's state machine
around it: idle, or in an epoch (which one, at which step), and the counts that end an epoch's
record (traces, rebuilds) and decide whether its signature is sent. Written by the worker's main
thread only.
"""

from __future__ import annotations

import enum

from ipc import wire


class Phase(str, enum.Enum):
    """The worker's current activity; its value travels in ``WorkerFailure.phase``."""

    STARTUP = "startup"  # building the EvalContext
    SOURCE = "source"  # calling the user's source(shard) and probing it
    FEEDERS = "feeders"  # calling the user's feeders(shard)
    IDLE = "idle"  # waiting for a command
    DALI = "dali"  # inside DALI: the source (a reader, or an ExternalSource's callback) or tracing
    LOAD = "load"  # inside sharded_source's load(index)
    STEP = "step"  # calling the user's step(...)
    TRANSPORT = "transport"  # copying a batch into a slot and sending its descriptor


#: What each phase of a worker's start does, in words (the trainer names the last one told when
#: a starting worker falls silent: ``wire.Starting``).
STARTING_DOING = {
    Phase.STARTUP: "importing DALI and making its EvalContext",
    Phase.SOURCE: "calling source(shard)",
    Phase.FEEDERS: "calling feeders(shard)",
}


class Activity:
    """The worker's phase, the epoch and step it is at (None between epochs), and its counts.

    Transitions: ``STARTUP`` -> (building the sources: ``SOURCE``, ``FEEDERS``) -> :meth:`idle`;
    :meth:`begin` an epoch (``DALI``), then per step ``DALI`` -> ``STEP`` -> ``TRANSPORT`` and
    :meth:`stepped`; at its end :meth:`ended` (its record), and :meth:`leave` it (back to
    ``IDLE``; early too, when aborted); :meth:`rebuilt` after the sources were built again.
    """

    def __init__(self) -> None:
        self.phase = Phase.STARTUP
        self.epoch: int | None = None
        self.step: int | None = None
        self.traces = 0  # epochs whose loop traced (captured anew)
        self.rebuilds = 0  # rebuilds of the sources since the worker started
        #: the last epoch this worker ran to its end since its sources were (re)built
        self.last_epoch_done: int | None = None

    def set_phase(self, phase: Phase) -> None:
        self.phase = phase

    def idle(self) -> None:
        """Between epochs, waiting for a command."""
        self.phase = Phase.IDLE

    def rebuilt(self) -> None:
        """The sources were built again: the next epoch sends a signature again, even eager."""
        self.phase = Phase.IDLE
        self.rebuilds += 1
        self.last_epoch_done = None

    def begin(self, epoch: int) -> None:
        """``epoch`` starts, at step 0, inside DALI."""
        self.epoch, self.step = epoch, 0
        self.phase = Phase.DALI

    def signature_due(self, tracing: bool) -> bool:
        """Whether the epoch beginning sends a signature: when it traces, and for the first
        epoch after the sources were (re)built."""
        return tracing or self.last_epoch_done is None

    def traced(self) -> None:
        """The epoch's first step traced its loop."""
        self.traces += 1

    def stepped(self, step: int) -> None:
        """``step`` steps of the epoch are done."""
        self.step = step

    def ended(self) -> wire.EpochEnd:
        """The epoch ran to its end: its record for the trainer (then :meth:`leave` it)."""
        assert self.epoch is not None and self.step is not None
        self.last_epoch_done = self.epoch
        return wire.EpochEnd(self.epoch, self.step, self.traces, self.rebuilds)

    def leave(self) -> None:
        """Out of the epoch (ended or aborted): idle."""
        self.epoch = self.step = None
        self.phase = Phase.IDLE
