"""``loader.stats()``: snapshots of per-worker and trainer-side counters. Runs in the trainer."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, make_dataclass
from operator import itemgetter
from typing import TYPE_CHECKING, NamedTuple

from ipc import wire
from ipc.limits import Limits, read_limits

from ._session import SessionView

if TYPE_CHECKING:
    from ..config import AutotuneReport

#: A worker's stages, in the order a batch goes through them (their one list: ``wire.STAGES``).
STAGES = wire.STAGES
#: ``Stages``'s times: the stages, then the other times of a batch (``wire.MEASURES``).
_TIMES = (*wire.STAGES, *wire.MEASURES)


class _Stages:
    """Seconds one worker spent in each stage, over all its batches (``WorkerStats.stages``) or
    over those of the last ``LoaderStats.window_seconds`` (``WorkerStats.recent``); divided by
    that window they are the fraction of the worker's time each stage took.

    ``load``: waiting for the source's samples (a ``sharded_source``/``sharded_files`` root: for
    its ``load``, which runs on a prefetch thread; other sources load inside DALI); ``dali``:
    running DALI (the pipeline, ``step``); ``blocked``: waiting for a free slot (the trainer is
    slower); ``publish``: copying batches into their slots; ``idle``: waiting for a command
    (between epochs). ``read`` and ``read_cpu``: the prefetch thread's wall and CPU time in
    ``load`` (much less CPU than wall: ``load`` waits on storage); ``cpu``: the worker process's
    CPU time, every thread.

    A frozen dataclass of ``batches`` (an int, 0 by default) and one float per name of
    ``wire.STAGES`` then ``wire.MEASURES`` (0.0 by default), made from those lists."""

    __slots__ = ()

    if TYPE_CHECKING:  # (the fields, as type checkers see them)
        batches: int

        def __init__(self, batches: int = 0, *seconds: float, **named: float) -> None: ...

        def __getattr__(self, name: str) -> float: ...

    def of(self, stage: str) -> float:
        """The seconds of ``stage`` (one of :data:`STAGES`)."""
        return float(getattr(self, stage))


if TYPE_CHECKING:
    Stages = _Stages
else:
    Stages = make_dataclass(
        "Stages",
        [("batches", int, 0), *((name, float, 0.0) for name in _TIMES)],
        bases=(_Stages,),
        namespace={"__doc__": _Stages.__doc__, "__module__": __name__},
        frozen=True,
    )

#: no time at all (``WorkerStats``'s default)
_NO_STAGES = Stages()


@dataclass(frozen=True)
class TrainerTimes:
    """The trainer's loop, in seconds: inside ``next(loader)``, ``waiting`` for the workers (no
    batch was ready) and the rest of it (``handling``: the loader's own work of handing a batch
    out), and between ``next()`` calls (``training``: the training step, and whatever else the
    loop does)."""

    batches: int = 0  # next() calls (an epoch's last, which raises StopIteration, included)
    waiting: float = 0.0
    handling: float = 0.0
    training: float = 0.0

    @property
    def loop(self) -> float:
        """The loop's time: inside and between ``next()`` calls."""
        return self.waiting + self.handling + self.training

    @property
    def waiting_fraction(self) -> float:
        """The fraction of the loop's time spent waiting for data."""
        loop = self.loop
        return self.waiting / loop if loop > 0 else 0.0

    @property
    def next_fraction(self) -> float:
        """The fraction of the loop's time spent inside ``next()`` (waiting or handling)."""
        loop = self.loop
        return (self.waiting + self.handling) / loop if loop > 0 else 0.0


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
    stages: Stages = _NO_STAGES  # since the start
    recent: Stages = _NO_STAGES  # over the last LoaderStats.window_seconds
    #: what its sources read for their samples since the start (Parquet: row groups read, the
    #: ranged requests and their bytes; footers and listings not counted), through the epoch of
    #: its latest batch (the next epoch's read-ahead counts with that epoch)
    row_groups_read: int = 0
    read_requests: int = 0
    bytes_read: int = 0


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
    trainer: TrainerTimes = TrainerTimes()  # since the start
    recent_trainer: TrainerTimes = TrainerTimes()  # over the last window_seconds
    #: the time the ``recent`` figures cover: the last ``window`` seconds asked of ``stats()``
    #: up to the latest ``next()``, less when the loader has delivered batches for less long
    #: (the traced first batch left out)
    window_seconds: float = 0.0
    cpus: int = 1  # the CPUs this rank's workers share (affinity / local ranks and xdist peers)
    #: with num_workers="auto" / num_threads="auto": the layout chosen and why
    autotune: AutotuneReport | None = None
    #: what the workers' sources leave out of every epoch, one line each: a damaged tar shard
    #: under on_error="skip" (what is wrong with it, what of it is read)
    left_out: tuple[str, ...] = ()
    #: what this process may use as the loader budgets it, read when ``stats()`` was called: CPUs
    #: (affinity and cgroup quota) and memory (available, cgroup limit and usage); see
    #: :class:`ipc.limits.Limits`
    limits: Limits | None = None
    #: optional members (``optional=`` of tars) given their default, by member: the real rows
    #: handed out so far that lacked it (a sample delivered in two epochs counts twice)
    defaulted: Mapping[str, int] = field(default_factory=dict)
    #: what the workers' sources read for their samples, all workers together (Parquet: row
    #: groups read, ranged requests and their bytes; see :class:`WorkerStats`)
    row_groups_read: int = 0
    read_requests: int = 0
    bytes_read: int = 0

    @property
    def samples_per_second(self) -> float:
        return 0.0 if self.iteration_seconds <= 0 else self.samples / self.iteration_seconds

    @property
    def batches_per_second(self) -> float:
        return 0.0 if self.iteration_seconds <= 0 else self.batches / self.iteration_seconds

    def rates(self) -> dict[str, float]:
        """A few scalars of the last ``window_seconds``, named for a logger (TensorBoard's
        ``add_scalar``, Lightning's ``log_dict``; see examples/): ``loader/waiting`` (the
        fraction of the loop's time spent waiting for data), ``loader/batches_per_second`` (of
        the loop), per worker stage the mean fraction of a worker's time
        (``loader/worker_load``, ``_dali``, ``_blocked``, ``_publish``, ``_idle``) and
        ``loader/worker_cpus`` (CPUs the workers kept busy)."""
        trainer, window = self.recent_trainer, self.window_seconds
        count = max(1, len(self.workers))
        rates = {
            "loader/waiting": trainer.waiting_fraction,
            "loader/batches_per_second": trainer.batches / trainer.loop if trainer.loop else 0.0,
        }
        for stage in STAGES:
            total = sum(w.recent.of(stage) for w in self.workers)
            rates[f"loader/worker_{stage}"] = total / (count * window) if window > 0 else 0.0
        cpu = sum(w.recent.cpu for w in self.workers)
        rates["loader/worker_cpus"] = cpu / window if window > 0 else 0.0
        return rates


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
    defaulted: dict[str, int] = field(default_factory=dict)

    def handed_out(
        self, now: float, real_samples: int, defaulted: tuple[tuple[str, int], ...] = ()
    ) -> None:
        self.batches += 1
        self.samples += real_samples
        for member, rows in defaulted:
            self.defaulted[member] = self.defaulted.get(member, 0) + rows
        self.last_batch_at = now
        if self.first_batch is None and self.iterating_since is not None:
            self.first_batch = now - self.iterating_since

    def ready(self, now: float, startup_wait_ns: int) -> None:
        """The first pool is ready: it waited ``startup_wait_ns`` for its workers."""
        self.ready_at, self.startup_wait_ns = now, startup_wait_ns

    def relaunched(self, startup_wait_ns: int) -> None:
        """A new pool replaced the old one: its startup wait is what counts as startup's."""
        self.startup_wait_ns = startup_wait_ns

    def iterating(self, now: float) -> None:
        """An epoch started: iteration runs from the first one's start."""
        if self.iterating_since is None:
            self.iterating_since = now

    def epoch_over(self, now: float) -> None:
        """An epoch ended without a batch more (its ``StopIteration``)."""
        self.last_batch_at = now


#: One worker's batch on the time line: epoch, the epoch's step, ns blocked on a slot, its times.
BatchRecord = tuple[int, int, int, wire.StageTimes]
#: One ``next()`` of the trainer: entered and left (``perf_counter_ns``), ns of it spent waiting
#: for the workers, epoch, the epoch's step of the batch it returned (-1: it raised
#: StopIteration), the worker that made it (-1: none).
NextRecord = tuple[int, int, int, int, int, int]
#: A part of a worker's start: its name, begin and end (``perf_counter_ns``).
StartSpan = tuple[str, int, int]


class StartSpans(NamedTuple):
    """Where one worker's start went, from the loader's creation on: in the worker's process
    (``own``: ``worker start``, ``sources``, and, spawned, ``import DALI``) and in the worker
    server it was forked from (``server``: its imports, warming and preparing this loader)."""

    own: tuple[StartSpan, ...]
    server: tuple[StartSpan, ...]


#: Records kept per worker, and of the trainer, for windows and the trace (about 100 bytes each).
CAPACITY = 8192

#: ``blocked`` is the one stage a batch's ``BatchReady`` carries (``blocked_ns``, after its start)
assert wire.IN_BATCH == ("blocked",) and "blocked" not in wire.BEFORE_START
#: Where each of ``_TIMES`` is in a batch's ``(*timing, blocked_ns)``: ``blocked_ns`` last, the
#: others the ``<name>_ns`` field of its ``wire.StageTimes``.
_IN_RECORD = tuple(
    len(wire.TIME_FIELDS) if name in wire.IN_BATCH else wire.TIME_FIELDS.index(f"{name}_ns")
    for name in _TIMES
)
#: ``(*timing, blocked_ns)`` -> the ns of each of ``_TIMES`` of one batch
_batch_ns = itemgetter(*_IN_RECORD)
#: ``WorkerTrack.totals``'s position (a ``Stages`` field's, ``batches`` first) of ``blocked``,
#: and of each other time with its index in ``wire.StageTimes``
_BLOCKED = 1 + _TIMES.index("blocked")
_FROM_TIMES = tuple((at, index) for at, index in enumerate(_IN_RECORD, 1) if at != _BLOCKED)
#: A batch's time line, as positions in ``_TIMES``: the stages before its ``started_ns``, those
#: after it (in order), all of them as laid out, and the measures (which overlap the stages).
_BEFORE = tuple(_TIMES.index(name) for name in wire.BEFORE_START)
_AFTER = tuple(_TIMES.index(name) for name in wire.STAGES if name not in wire.BEFORE_START)
_LAID_OUT = (*_BEFORE, *_AFTER)
_MEASURED = tuple(_TIMES.index(name) for name in wire.MEASURES)


class WorkerTrack:
    """One worker's batches on the time line: running totals, and the latest records."""

    __slots__ = ("records", "totals")

    def __init__(self, capacity: int) -> None:
        self.records: deque[BatchRecord] = deque(maxlen=capacity)
        #: batches, then the ns of each stage and measure (``Stages``'s fields, in order)
        self.totals = [0] * (1 + len(_TIMES))

    def add(self, epoch: int, step: int, blocked_ns: int, timing: wire.StageTimes) -> None:
        self.records.append((epoch, step, blocked_ns, timing))
        totals = self.totals
        totals[0] += 1
        totals[_BLOCKED] += blocked_ns
        for at, index in _FROM_TIMES:
            totals[at] += timing[index]

    def total(self) -> Stages:
        return _stages(self.totals)

    def window(self, start_ns: int, end_ns: int) -> Stages:
        """The time within ``[start_ns, end_ns]``: each stage's span (laid out as in the
        trace) cut to the window; the measures (``read``, ``read_cpu``, ``cpu``) in proportion
        to the part of their batch inside it. ``batches``: those that ended inside it."""
        sums = [0] * (1 + len(_TIMES))
        for _epoch, _step, blocked, timing in reversed(self.records):
            started = timing.started_ns
            ns: tuple[int, ...] = _batch_ns((*timing, blocked))
            end = started + sum([ns[i] for i in _AFTER])
            if end < start_ns:
                break
            first = started - sum([ns[i] for i in _BEFORE])
            if first >= end_ns:
                continue
            if end <= end_ns:
                sums[0] += 1
            at = first
            inside = 0
            for i in _LAID_OUT:
                length = ns[i]
                cut = min(at + length, end_ns) - max(at, start_ns)
                if cut > 0:
                    sums[1 + i] += cut
                    inside += cut
                at += length
            whole = end - first
            share = 1.0 if whole <= 0 or inside >= whole else inside / whole
            for i in _MEASURED:
                sums[1 + i] += int(ns[i] * share)
        return _stages(sums)


def batch_end(timing: wire.StageTimes, blocked_ns: int) -> int:
    """When a batch was in its slot (``perf_counter_ns``): its start and the stages after it."""
    ns: tuple[int, ...] = _batch_ns((*timing, blocked_ns))
    return timing.started_ns + sum([ns[i] for i in _AFTER])


def _stages(ns: list[int]) -> Stages:
    return Stages(ns[0], *(value / 1e9 for value in ns[1:]))


@dataclass
class Timeline:
    """Where the time went, always on: every batch's stage times per worker (from its
    ``BatchReady``) and the trainer's ``next()`` calls, as running totals and as the latest
    :data:`CAPACITY` records of each (what windows and the trace are made of). Clock:
    ``time.perf_counter_ns``, the same in the workers (``CLOCK_MONOTONIC``)."""

    num_workers: int
    capacity: int = CAPACITY
    origin_ns: int = field(default_factory=time.perf_counter_ns)
    workers: list[WorkerTrack] = field(init=False)
    calls: deque[NextRecord] = field(init=False)
    waiting_ns: int = 0
    handling_ns: int = 0
    training_ns: int = 0
    next_calls: int = 0
    #: when the first next() that returned a batch left (the traced first step is before it)
    warm_ns: int | None = None
    left_ns: int | None = None  # when the latest next() left
    #: where each worker's latest start went: its own spans, then its server's (wire.Hello)
    starts: dict[int, StartSpans] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.workers = [WorkerTrack(self.capacity) for _ in range(self.num_workers)]
        self.calls = deque(maxlen=2 * self.capacity)

    def ensure(self, num_workers: int) -> None:
        """Tracks for ``num_workers`` workers at least."""
        while len(self.workers) < num_workers:
            self.workers.append(WorkerTrack(self.capacity))
        self.num_workers = len(self.workers)

    def started(self, worker: int, hello: wire.Hello) -> None:
        """``worker``'s process said Hello: keep where its start went, from the loader's creation
        on (a span that began before it is cut there; one that ended before it is left out)."""
        own: list[StartSpan] = []
        server: list[StartSpan] = []
        for name, begin, end, pid in hello.startup:
            if end > self.origin_ns:
                (own if pid == hello.pid else server).append(
                    (name, max(begin, self.origin_ns), end)
                )
        self.starts[worker] = StartSpans(tuple(own), tuple(server))

    def batch(self, worker: int, step: int, message: wire.BatchReady) -> None:
        """A batch arrived from ``worker`` (``step``: the epoch's step of it)."""
        self.workers[worker].add(message.epoch, step, message.blocked_ns, message.timing)

    def next_call(
        self,
        entered_ns: int,
        waited_ns: int,
        epoch: int,
        step: int,
        worker: int,
        left_ns: int | None = None,
    ) -> None:
        """A ``next(loader)`` entered at ``entered_ns`` leaves now (or at ``left_ns``), having
        waited ``waited_ns`` of it for the workers."""
        left = time.perf_counter_ns() if left_ns is None else left_ns
        previous = self.left_ns
        if previous is not None:
            self.training_ns += entered_ns - previous
        inside = left - entered_ns
        waited = min(max(0, waited_ns), inside)
        self.waiting_ns += waited
        self.handling_ns += inside - waited
        self.next_calls += 1
        self.left_ns = left
        if self.warm_ns is None and step >= 0:
            self.warm_ns = left
        self.calls.append((entered_ns, left, waited, epoch, step, worker))

    def trainer_total(self) -> TrainerTimes:
        return TrainerTimes(
            self.next_calls,
            self.waiting_ns / 1e9,
            self.handling_ns / 1e9,
            self.training_ns / 1e9,
        )

    def span(self, seconds: float, now_ns: int | None = None) -> tuple[int, int]:
        """The last ``seconds`` up to the latest ``next()`` (or now, before any), from the
        first delivered batch on at the earliest."""
        end = self.left_ns if self.left_ns is not None else (now_ns or time.perf_counter_ns())
        start = max(end - int(seconds * 1e9), self.warm_ns or self.origin_ns)
        return min(start, end), end

    def trainer_window(self, start_ns: int, end_ns: int) -> TrainerTimes:
        calls = waiting = handling = training = 0
        following: int | None = None  # when the next call (later in time) entered
        for entered, left, waited, _epoch, _step, _worker in reversed(self.calls):
            if entered > end_ns:
                following = entered
                continue
            if left < start_ns:
                if following is not None:  # (the call after it may have entered before too)
                    training += max(0, following - start_ns)
                break
            calls += 1
            inside = left - max(entered, start_ns)
            waited = min(waited, inside)  # (a call cut by the window: its wait comes first)
            waiting += waited
            handling += inside - waited
            if following is not None:
                training += following - left
            following = entered
        return TrainerTimes(calls, waiting / 1e9, handling / 1e9, training / 1e9)

    def worker_records(self, worker: int, start_ns: int) -> Iterator[BatchRecord]:
        """``worker``'s records of batches that ended at ``start_ns`` or later, in order."""
        records = self.workers[worker].records
        for record in records:
            if batch_end(record[3], record[2]) >= start_ns:
                yield record

    def next_records(self, start_ns: int) -> Iterator[NextRecord]:
        for record in self.calls:
            if record[1] >= start_ns:
                yield record


def worker_stats(
    view: SessionView, timeline: Timeline | None = None, span: tuple[int, int] = (0, 0)
) -> WorkerStats:
    counters = view.counters
    busy = counters.busy_ns / 1e9
    track = None if timeline is None else timeline.workers[view.index]
    return WorkerStats(
        worker=view.index,
        shard=view.shard.index,
        pid=view.handle.pid,
        steps=counters.steps,
        traces=counters.traces,
        rebuilds=counters.rebuilds,
        trace_seconds=tuple(counters.trace_seconds),
        busy_seconds=busy,
        blocked_seconds=counters.blocked_ns / 1e9,
        batches_per_second=counters.steps / busy if busy > 0 else 0.0,
        bytes=counters.bytes,
        restarts=counters.restarts,
        row_groups_read=counters.total_reads[0],
        read_requests=counters.total_reads[1],
        bytes_read=counters.total_reads[2],
        stages=Stages() if track is None else track.total(),
        recent=Stages() if track is None else track.window(*span),
    )


def snapshot(
    views: Sequence[SessionView],
    trainer: TrainerCounters,
    *,
    now: float,
    wait_ns: int,
    skipped: dict[int, str],
    restarts: int,
    found_left_out: tuple[str, ...] = (),
    timeline: Timeline | None = None,
    window: float = 10.0,
    cpus: int = 1,
) -> LoaderStats:
    span = (0, 0) if timeline is None else timeline.span(window)
    workers = tuple(worker_stats(view, timeline, span) for view in views)
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
        slots_in_use=sum(v.slots_held for v in views),
        skipped=tuple(skipped.items()),
        left_out=tuple(
            sorted(
                {line for v in views if v.hello is not None for line in v.hello.left_out}
                | set(found_left_out)
            )
        ),
        restarts=restarts,
        startup_seconds=ready - trainer.created,
        iteration_seconds=iterating,
        time_to_first_batch=trainer.first_batch,
        trainer=TrainerTimes() if timeline is None else timeline.trainer_total(),
        recent_trainer=TrainerTimes() if timeline is None else timeline.trainer_window(*span),
        window_seconds=(span[1] - span[0]) / 1e9,
        cpus=cpus,
        limits=read_limits(),
        defaulted=dict(trainer.defaulted),
        row_groups_read=sum(w.row_groups_read for w in workers),
        read_requests=sum(w.read_requests for w in workers),
        bytes_read=sum(w.bytes_read for w in workers),
    )
