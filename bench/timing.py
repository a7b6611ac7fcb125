"""``python -m bench.timing``: what always-on per-stage timing costs per batch.

Times exactly the per-batch work the timing adds, with ``timeit`` (best of 5 runs): on a
worker's main thread (``BatchClock.begin``/``evaluated``/``stages``, packing the 64 bytes of
``StageTimes``, the wait timer around a sharded source's samples), on its prefetch thread (the
wall and CPU timers around ``load_batch``), and in the trainer (decoding ``StageTimes``,
``Timeline.batch``, ``Timeline.next_call``). Compare with the time per batch of the tiny workload
(``python -m bench --quick``) on the same machine; the target is <= 1%.
"""

from __future__ import annotations

import argparse
import time
import timeit

from bench import _harness as H
from ipc.wire import TIMING, BatchReady, OutputPlacement, StageTimes
from loader import Timeline
from workers import BatchClock

RUNS = 200_000


class _Totals:
    """The three running totals a BatchedSamples keeps."""

    wait_ns = 0
    load_ns = 0
    load_cpu_ns = 0


def parser() -> argparse.ArgumentParser:
    return H.parser("timing", __doc__)


def main(argv: list[str] | None = None) -> None:
    parser().parse_args(argv)
    totals = _Totals()
    clock = BatchClock()
    clock.follow(totals)

    def worker_main_thread() -> None:
        clock.begin()
        waited = time.perf_counter_ns()
        totals.wait_ns += time.perf_counter_ns() - waited
        clock.evaluated()
        TIMING.pack(*clock.stages(0))

    def worker_prefetch_thread() -> None:
        wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
        totals.load_cpu_ns += time.thread_time_ns() - cpu
        totals.load_ns += time.perf_counter_ns() - wall

    timeline = Timeline(2)
    placement = OutputPlacement("x", "|u1", 0, 128, ((4, 4),) * 8, True, "")
    frame = TIMING.pack(*StageTimes(1, 2, 3, 4, 5, 6, 7, 8))

    message = BatchReady(0, 1, 0, 0, 1, (placement,), 128, 0, 0, 0)  # (made anyway)

    def trainer() -> None:
        StageTimes._make(TIMING.unpack_from(frame, 0))
        timeline.batch(0, 1, message)
        timeline.next_call(time.perf_counter_ns(), 0, 0, 1, 0)

    def baseline() -> None:
        pass

    empty = min(timeit.repeat(baseline, number=RUNS, repeat=5)) / RUNS
    rows = []
    for name, work in (
        ("worker main thread", worker_main_thread),
        ("worker prefetch thread", worker_prefetch_thread),
        ("trainer", trainer),
    ):
        best = min(timeit.repeat(work, number=RUNS, repeat=5)) / RUNS - empty
        rows.append((name, best * 1e6))
    H.print_table([H.Col("where", left=True), H.Col("us per batch", ".2f")], rows)
    print(f"(one time.perf_counter_ns() here: {_clock_cost() * 1e6:.2f} us)")


def _clock_cost() -> float:
    return min(timeit.repeat(time.perf_counter_ns, number=RUNS, repeat=5)) / RUNS


if __name__ == "__main__":
    main()
