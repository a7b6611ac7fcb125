"""Per-stage timing of a worker's batches, always on. Runs in the worker, on its main thread.

A :class:`BatchClock` follows the main thread through each batch: the step starts
(:meth:`~BatchClock.begin`), DALI's outputs are ready (:meth:`~BatchClock.evaluated`), the
outputs are in their slot (:meth:`~BatchClock.stages`, which also takes the time spent waiting
for that slot). What a ``sharded_source``/``sharded_files`` root spent loading comes from its
running totals (:class:`~workers.sources.plan._sampling.BatchedSamples`), read once per batch;
time spent waiting for a command between epochs is added by the command loop
(:meth:`~BatchClock.idle`). Each batch's :class:`~ipc.wire.StageTimes` travels in its
``BatchReady``.

Cost: a few clock reads per batch (about 1 us in all), see docs/diagnosis.md.
"""

from __future__ import annotations

import time
from typing import Any

from ipc.wire import StageTimes

_clock = time.perf_counter_ns
_cpu = time.process_time_ns


class BatchClock:
    """The stage times of the batch in progress, and the running totals they are deltas of."""

    __slots__ = (
        "_cpu",
        "_evaluated",
        "_idle",
        "_load",
        "_load_cpu",
        "_sampled",
        "_started",
        "_wait",
    )

    def __init__(self) -> None:
        self._sampled: Any = None  # the BatchedSamples whose totals are read (None: no loads)
        self._started = 0
        self._evaluated = 0
        self._wait = self._load = self._load_cpu = 0
        self._cpu = _cpu()
        self._idle = 0

    def follow(self, sampled: Any) -> None:
        """Read load times from ``sampled`` (a ``BatchedSamples``, or None) from now on."""
        self._sampled = sampled
        if sampled is None:
            self._wait = self._load = self._load_cpu = 0
        else:
            self._wait, self._load, self._load_cpu = (
                sampled.wait_ns,
                sampled.load_ns,
                sampled.load_cpu_ns,
            )

    def idle(self, nanoseconds: int) -> None:
        """Time spent waiting for a command; it goes with the next batch."""
        self._idle += nanoseconds

    def begin(self) -> int:
        """A step starts now; returns the time (``perf_counter_ns``)."""
        self._started = now = _clock()
        return now

    def evaluated(self) -> None:
        """DALI's outputs of this step are ready."""
        self._evaluated = _clock()

    def stages(self, blocked_ns: int) -> StageTimes:
        """The batch is in its slot: its stage times (``blocked_ns``: waiting for the slot)."""
        now = _clock()
        cpu = _cpu()
        sampled = self._sampled
        if sampled is None:
            wait = read = read_cpu = 0
        else:
            total_wait, total_load, total_load_cpu = (
                sampled.wait_ns,
                sampled.load_ns,
                sampled.load_cpu_ns,
            )
            wait, read, read_cpu = (
                total_wait - self._wait,
                total_load - self._load,
                total_load_cpu - self._load_cpu,
            )
            self._wait, self._load, self._load_cpu = total_wait, total_load, total_load_cpu
        started, evaluated = self._started, self._evaluated or now
        times = StageTimes(  # (by name: the fields' order is ``ipc.wire.TIME_FIELDS``'s)
            started_ns=started,
            load_ns=wait,
            dali_ns=max(0, evaluated - started - wait),
            publish_ns=max(0, now - evaluated - blocked_ns),
            idle_ns=self._idle,
            read_ns=read,
            read_cpu_ns=read_cpu,
            cpu_ns=cpu - self._cpu,
        )
        self._cpu = cpu
        self._idle = 0
        self._evaluated = 0
        return times
