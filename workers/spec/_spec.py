"""What the trainer tells a worker at spawn time. Pickled once, by the trainer, into the child."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ._shard import Shard

SourceFactory = Callable[[Shard], Any]
FeederFactory = Callable[[Shard], Mapping[str, Any]]
StepFunction = Callable[..., Any]


@dataclass(frozen=True)
class WorkerSpec:
    """Everything one worker needs; functions travel by reference (module and qualified name)."""

    #: a dataset definition (``workers.sources.Definition``, pickled by value; opened in the
    #: worker with ``batch_size``) or a :data:`SourceFactory`
    source: SourceFactory | Any
    step: StepFunction
    feeders: FeederFactory | None
    shard: Shard
    batch_size: int
    capture: bool
    device: str  # "cpu" or "gpu"
    device_id: int | None
    num_threads: int
    num_slots: int
    parent_pid: int
    parent_death_signal: bool
    log_level: int
    shm_limit: int | None = None  # bytes of shared memory this worker's arena may use
    on_error: str = "raise"  # "skip": corrupt samples are replaced and reported
    #: the same for the workers started together (a pool): they may share what each would
    #: otherwise ask the store for (a listing of the shards' directory)
    started_together: str = ""
    bad_samples: frozenset[int] = frozenset()  # sample ids known to fail (replaced, not loaded)
    #: the random generators' states for the first batch (a replacement goes on with those of
    #: the batch it starts at); empty: seeded from the seed, the shard and the epoch
    random: bytes = b""

    def call_step(self, inputs: Any, feeders: Mapping[str, Any]) -> Any:
        """The user's ``step`` on one batch of the source's ``inputs`` (a mapping: by name; a
        tuple: in order; else alone) and the ``feeders``' batches (by name)."""
        if isinstance(inputs, Mapping):
            return self.step(**inputs, **feeders)
        if isinstance(inputs, tuple):
            return self.step(*inputs, **feeders)
        return self.step(inputs, **feeders)
