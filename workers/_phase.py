"""What a worker is doing, named in every error it reports. Runs in the worker."""

from __future__ import annotations

import enum


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
