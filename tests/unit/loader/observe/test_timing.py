"""Stage times on the wire, the trainer's time line and windows, and the verdict's rules."""

from __future__ import annotations

import pickle
from typing import Any

from ipc.wire import FRAME, BatchCodec, BatchReady, OutputPlacement, StageTimes
from loader.engine._stats import LoaderStats, Stages, Timeline, TrainerTimes, WorkerStats
from loader.observe._diagnose import diagnose

PLACEMENT = OutputPlacement("id", "<i8", 0, 64, ((8,),), True, "")


def _batch(step: int, timing: StageTimes, **fields: object) -> BatchReady:
    return BatchReady(0, step, 0, 1, 3, (PLACEMENT,), 64, 0, 5, 9, timing=timing, **fields)  # type: ignore[arg-type]


def _decode(codec: BatchCodec, frame: bytes) -> object:
    size, kind = FRAME.unpack_from(frame)
    if kind == 0:
        return pickle.loads(frame[FRAME.size :])
    return codec.decode(kind, frame, FRAME.size, FRAME.size + size)


def test_stage_times_travel_with_every_batch() -> None:
    timing = StageTimes(10**15, 1, 2, 3, 4, 5, 6, 7)
    sender, receiver = BatchCodec(), BatchCodec()
    binary = _batch(0, timing, random=b"abc")
    assert _decode(receiver, sender.encode(binary)) == binary
    pickled = _batch(1, timing, replaced=(2,), skipped=(7,), skipped_names=("x",))
    assert _decode(receiver, sender.encode(pickled)) == pickled
    assert _decode(receiver, sender.encode(_batch(2, StageTimes()))).timing == StageTimes()


def test_windows_count_the_batches_and_calls_inside_them() -> None:
    timeline = Timeline(1)
    ms = 1_000_000
    base = timeline.origin_ns
    for step in range(10):  # one batch every 10 ms: 2 load, 3 dali, 1 publish; 4 of load() (read)
        start = base + step * 10 * ms
        timeline.batch(0, step, _batch(step, StageTimes(start, 2 * ms, 3 * ms, ms, 0, 4 * ms)))
    totals = timeline.workers[0].total()
    assert totals.batches == 10 and abs(totals.load - 0.020) < 1e-9
    assert abs(totals.blocked - 10 * 5e-9) < 1e-12  # (_batch's blocked_ns is 5)
    recent = timeline.workers[0].window(base + 50 * ms, base + 100 * ms)
    assert recent.batches == 5 and abs(recent.dali - 0.015) < 1e-9
    cut = timeline.workers[0].window(base + 51 * ms, base + 100 * ms)  # 1 ms into batch 5's load
    assert cut.batches == 5 and abs(cut.load - 0.009) < 1e-9 and abs(cut.dali - 0.015) < 1e-9
    assert abs(cut.read - (4 * 0.004 + 0.004 * 5 / 6)) < 1e-6  # batch 5: 5 of its 6 ms inside

    # the trainer: 4 ms inside each next(), 3 of them waiting, 6 ms between calls
    for call in range(10):
        entered = base + call * 10 * ms
        timeline.next_call(entered, 3 * ms, 0, call, 0, left_ns=entered + 4 * ms)
    total = timeline.trainer_total()
    assert total.batches == 10
    assert abs(total.waiting - 0.030) < 1e-9 and abs(total.handling - 0.010) < 1e-9
    assert abs(total.training - 0.054) < 1e-9  # 9 gaps of 6 ms
    # the last 45 ms up to the last call's end (94 ms): calls 5..9 and 1 ms of training before
    window = timeline.trainer_window(*timeline.span(0.045))
    assert window.batches == 5
    assert abs(window.waiting - 0.015) < 1e-9
    assert abs(window.training - (4 * 0.006 + 0.001)) < 1e-9
    assert abs(window.waiting_fraction - 0.015 / 0.045) < 1e-9


def _stats(
    *,
    waiting: float,
    training: float,
    stage: str,
    share: float,
    cpu: float,
    read: float = 0.0,
    read_cpu: float = 0.0,
) -> LoaderStats:
    window = 10.0
    stages = Stages(
        batches=100, **{stage: share * window}, cpu=cpu * window / 2, read=read, read_cpu=read_cpu
    )  # type: ignore[arg-type]
    workers = tuple(
        WorkerStats(w, w, None, 100, 1, 0, (0.1,), 1.0, 0.0, 100.0, 0, 0, stages, stages)
        for w in range(2)
    )
    trainer = TrainerTimes(200, waiting, 0.0, training)
    return LoaderStats(
        workers, 200, 1600, 0, 0.0, 0, (), 0, 1.0, window, 0.1, trainer, trainer, window, cpus=2
    )


def test_the_verdict_follows_the_numbers() -> None:
    settings: dict[str, Any] = {
        "num_threads": 1,
        "prefetch": 2,
        "in_order": True,
        "machine": (0.5, 2),
    }
    saturated = diagnose(
        _stats(waiting=4, training=6, stage="dali", share=0.9, cpu=1.9), **settings
    )
    assert saturated.input_bound and saturated.workers == "cpu-saturated"
    assert "more workers will not help" in saturated.suggestion
    assert "1.9 of 2 CPUs" in saturated.suggestion
    assert saturated.verdict == "input-bound: the trainer waited 40% of the time"

    starved = diagnose(_stats(waiting=4, training=6, stage="dali", share=0.9, cpu=0.5), **settings)
    assert starved.workers == "busy in dali" and "num_workers=" in starved.suggestion

    copying = diagnose(
        _stats(waiting=2, training=8, stage="publish", share=0.7, cpu=0.5), **settings
    )
    assert copying.dominant_stage == "publish" and "fewer bytes" in copying.suggestion

    fine = diagnose(
        _stats(waiting=0.01, training=9.99, stage="blocked", share=0.8, cpu=0.3), **settings
    )
    assert not fine.input_bound and fine.workers == "blocked on full slots"
    assert fine.verdict == "not input-bound: the trainer waited 0.1% of the time"

    io = diagnose(
        _stats(waiting=5, training=5, stage="load", share=0.9, cpu=0.1, read=18, read_cpu=1),
        **settings,
    )
    assert io.workers == "waiting on I/O" and "num_workers=4" in io.suggestion

    crowded = {**settings, "machine": (6.0, 2)}
    starved = diagnose(_stats(waiting=4, training=6, stage="dali", share=0.9, cpu=0.5), **crowded)
    assert starved.workers == "starved of CPU"
    assert "load average 6.0 on 2 CPUs" in starved.suggestion
    assert "more workers will not help" in starved.suggestion
