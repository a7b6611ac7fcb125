"""``loader.stats()``: snapshots of per-worker and trainer-side counters. Runs in the trainer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ._session import WorkerSession


@dataclass(frozen=True)
class WorkerStats:
    worker: int
    shard: int
    pid: int | None
    steps: int
    traces: int
    rebuilds: int
    trace_seconds: tuple[float, ...]
    busy_seconds: float
    blocked_seconds: float
    batches_per_second: float  # batches per second of the worker's busy time
    bytes: int
    restarts: int = 0  # times this worker's process was replaced


@dataclass(frozen=True)
class LoaderStats:
    """Counters of one loader. ``startup_seconds`` (construction until every worker is ready)
    is kept apart from ``iteration_seconds`` (the first ``iter(loader)`` until the latest
    delivered batch or epoch end), which the rates are computed over."""

    workers: tuple[WorkerStats, ...]
    batches: int
    samples: int  # real samples delivered (padded and replaced rows are not counted)
    bytes_moved: int
    wait_seconds: float  # the trainer's time waiting for workers after startup
    slots_in_use: int
    skipped: tuple[tuple[int, str], ...]  # (sample id, name) of each sample skipped, once
    restarts: int  # worker processes replaced so far
    startup_seconds: float
    iteration_seconds: float
    time_to_first_batch: float | None  # from the first iter(loader)

    @property
    def samples_per_second(self) -> float:
        return 0.0 if self.iteration_seconds <= 0 else self.samples / self.iteration_seconds

    @property
    def batches_per_second(self) -> float:
        return 0.0 if self.iteration_seconds <= 0 else self.batches / self.iteration_seconds


@dataclass
class TrainerCounters:
    """What the trainer counts itself: batches and samples handed out, and when."""

    created: float
    ready_at: float | None = None
    iterating_since: float | None = None
    last_batch_at: float | None = None
    first_batch: float | None = None
    startup_wait_ns: int = 0
    batches: int = 0
    samples: int = 0

    def handed_out(self, now: float, real_samples: int) -> None:
        self.batches += 1
        self.samples += real_samples
        self.last_batch_at = now
        if self.first_batch is None and self.iterating_since is not None:
            self.first_batch = now - self.iterating_since


def worker_stats(session: WorkerSession) -> WorkerStats:
    counters = session.counters
    busy = counters.busy_ns / 1e9
    return WorkerStats(
        worker=session.index,
        shard=session.shard.index,
        pid=session.handle.pid,
        steps=counters.steps,
        traces=counters.traces,
        rebuilds=counters.rebuilds,
        trace_seconds=tuple(counters.trace_seconds),
        busy_seconds=busy,
        blocked_seconds=counters.blocked_ns / 1e9,
        batches_per_second=counters.steps / busy if busy > 0 else 0.0,
        bytes=counters.bytes,
        restarts=counters.restarts,
    )


def snapshot(
    sessions: Sequence[WorkerSession],
    trainer: TrainerCounters,
    *,
    now: float,
    wait_ns: int,
    skipped: dict[int, str],
    restarts: int,
) -> LoaderStats:
    workers = tuple(worker_stats(session) for session in sessions)
    ready = trainer.ready_at if trainer.ready_at is not None else now
    iterating = 0.0
    if trainer.iterating_since is not None and trainer.last_batch_at is not None:
        iterating = trainer.last_batch_at - trainer.iterating_since
    return LoaderStats(
        workers=workers,
        batches=trainer.batches,
        samples=trainer.samples,
        bytes_moved=sum(w.bytes for w in workers),
        wait_seconds=(wait_ns - trainer.startup_wait_ns) / 1e9,
        slots_in_use=sum(s.reader.held for s in sessions),
        skipped=tuple(skipped.items()),
        restarts=restarts,
        startup_seconds=ready - trainer.created,
        iteration_seconds=iterating,
        time_to_first_batch=trainer.first_batch,
    )
