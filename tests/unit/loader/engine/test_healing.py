"""Healing's decisions (:mod:`loader.engine._healing`): the restart budget, where a replacement
starts, failing samples and the skip limit, and how long each wait is, from snapshots."""

from __future__ import annotations

import logging

import pytest

from ipc import wire
from ipc.wire import Sampling
from loader.engine._healing import REPLACEMENT_START, Fail, Healing, Replace, Timeouts
from loader.engine._session import Aborting, Idle, Running, Stopped, WorkerCounters
from loader.errors import SkipLimitError, WorkerDiedError

from .fakes import FakeHandle, batch, shard, view

HELLO = wire.Hello(1, 1, None, 8, sampling=Sampling(64, 8, 0, False, False))


def _healing(max_restarts: int = 2, on_error: str = "raise", **kwargs: object) -> Healing:
    return Healing(
        max_restarts=max_restarts,
        on_error=on_error,
        max_skipped=kwargs.pop("max_skipped", None),  # type: ignore[arg-type]
        timeouts=kwargs.pop("timeouts", Timeouts(10.0, 100.0, 300.0)),  # type: ignore[arg-type]
    )


def _died() -> WorkerDiedError:
    return WorkerDiedError("worker 0 died", worker=0, pid=None, exitcode=-9, signal_name="SIGKILL")


def test_no_restart_by_default_fails_with_the_plain_message() -> None:
    error = _died()
    decision, found = _healing(max_restarts=0).decide(view(hello=HELLO), error, "died")
    assert decision == Fail(error) and found is None
    assert error.args[0] == "worker 0 died"


def test_a_running_worker_is_replaced_at_its_first_undelivered_batch() -> None:
    healing = _healing()
    snapshot = view(1, Running(3), hello=HELLO, epoch=3, delivered=5, base_step=2, random=b"states")
    decision, _ = healing.decide(snapshot, _died(), "died")
    assert isinstance(decision, Replace)
    assert decision.target == Running(3) and decision.first_step == 7 and decision.budgeted
    assert decision.spec.random == b"states"  # the generators of the batch it makes again
    assert decision.spec.shard.epoch == 3 and decision.spec.shard.index == 1
    assert decision.spec.shard.position is not None  # it goes on mid-shard
    assert healing.restarts == 1


def test_the_restart_budget_runs_out() -> None:
    healing = _healing(max_restarts=1)
    snapshot = view(target=Running(0), hello=HELLO, epoch=0)
    assert isinstance(healing.decide(snapshot, _died(), "died")[0], Replace)
    error = _died()
    decision, _ = healing.decide(snapshot, error, "died")
    assert decision == Fail(error)
    assert "the restart budget (max_restarts=1) is spent" in error.args[0]


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"hello": None}, "the worker never started"),
        ({"hello": wire.Hello(1, 1, None, 8)}, "the source cannot start mid-shard"),
        ({"hello": HELLO, "target": Stopped(failed=True)}, "the loader is closing"),
    ],
)
def test_a_worker_that_cannot_be_replaced_fails_saying_why(
    fields: dict[str, object], reason: str
) -> None:
    error = _died()
    target = fields.pop("target", Running(0))
    decision, _ = _healing().decide(view(target=target, **fields), error, "died")  # type: ignore[arg-type]
    assert isinstance(decision, Fail) and reason in error.args[0]


def test_an_ended_worker_with_batches_queued_is_replaced_like_a_running_one() -> None:
    snapshot = view(target=Running(0, ended=True), hello=HELLO, epoch=0, queued=2, delivered=6)
    decision, _ = _healing().decide(snapshot, _died(), "died")
    assert isinstance(decision, Replace)
    assert decision.target == Running(0) and decision.first_step == 6


@pytest.mark.parametrize(
    ("target", "new"),
    [
        (Running(2, ended=True), Idle(3)),  # ended and drained: ready for the next epoch
        (Aborting(2), Idle(3)),
        (Idle(4), Idle(4)),
    ],
)
def test_a_worker_between_epochs_is_replaced_ready_for_the_next(target: object, new: Idle) -> None:
    decision, _ = _healing().decide(view(target=target, hello=HELLO, first_step=9), _died(), "x")  # type: ignore[arg-type]
    assert isinstance(decision, Replace)
    assert decision.target == new and decision.first_step == 9
    assert decision.spec.shard.epoch == new.epoch


def test_a_worker_that_exits_after_failing_samples_is_replaced_outside_the_budget() -> None:
    healing = _healing(max_restarts=0, on_error="skip")
    snapshot = view(target=Running(0), hello=HELLO, epoch=0)
    told = healing.samples_failed(snapshot, wire.SamplesFailed(0, 1, (5,), ("five",), "bad"))
    assert told == wire.BadSamples((5,))
    decision, _ = healing.decide(snapshot, _died(), "exited")
    assert isinstance(decision, Replace) and not decision.budgeted
    assert decision.spec.bad_samples == frozenset({5})
    assert healing.restarts == 0
    assert isinstance(healing.decide(snapshot, _died(), "died")[0], Fail)  # once only


def test_failing_samples_are_told_to_the_others_once(caplog: pytest.LogCaptureFixture) -> None:
    healing = _healing(on_error="skip")
    snapshot = view(1, Running(2), epoch=2, first_step=10)
    message = wire.SamplesFailed(2, 3, (5, 6), ("5", "six"), "it raised", exits=False)
    with caplog.at_level(logging.WARNING, "loader"):
        assert healing.samples_failed(snapshot, message) == wire.BadSamples((5, 6))
    assert "skipped sample 5: worker 1" in caplog.text
    assert "sample 6 (six)" in caplog.text and "its own step 13" in caplog.text  # 10 + 3
    again = wire.SamplesFailed(2, 4, (6, 7), ("six", "7"), "it raised", exits=False)
    assert healing.samples_failed(snapshot, again) == wire.BadSamples((7,))
    assert healing.bad_samples == {5, 6, 7}


def test_many_samples_failing_for_one_reason_are_logged_a_few_then_in_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A damaged row group: each of its rows fails for the same reason. A line each for the
    first few, one saying the rest go without a line; another reason is logged again."""
    healing = _healing(on_error="skip")
    snapshot = view(1, Running(2), epoch=0)
    reason = "DamagedRowGroup: a.parquet: row group 1 (bytes 10-20) cannot be read"
    with caplog.at_level(logging.WARNING, "loader"):
        for step in range(4):  # (batches of 4 rows of the row group)
            ids = tuple(range(4 * step, 4 * step + 4))
            message = wire.SamplesFailed(0, step, ids, tuple(map(str, ids)), reason, exits=False)
            healing.samples_failed(snapshot, message)
        other = wire.SamplesFailed(0, 5, (99,), ("99",), "another reason", exits=False)
        healing.samples_failed(snapshot, other)
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(":")[0] for line in lines[:5]] == [f"skipped sample {i}" for i in range(5)]
    assert lines[5].startswith("more samples fail for the same reason (DamagedRowGroup")
    assert lines[6].startswith("skipped sample 99") and len(lines) == 7
    assert healing.bad_samples == set(range(16)) | {99}


def test_a_hung_load_under_skip_is_skipped_and_the_worker_replaced() -> None:
    healing = _healing(on_error="skip")
    error = _died()
    error.hung_load = wire.LoadRunning(11, 30.0, "eleven", 0, 2)  # type: ignore[attr-defined]
    decision, found = healing.decide(view(target=Running(0), hello=HELLO, epoch=0), error, "x")
    assert isinstance(decision, Replace) and decision.budgeted
    assert found == wire.BadSamples((11,))
    assert decision.spec.bad_samples == frozenset({11})


def test_skipped_samples_past_the_limit_fail_the_epoch() -> None:
    healing = _healing(max_skipped=2)
    assert healing.delivered(batch(0, skipped=(1, 2), skipped_names=("a", "b")), 100) is None
    error = healing.delivered(batch(1, skipped=(3,), skipped_names=("c",)), 100)
    assert isinstance(error, SkipLimitError)
    assert "3 samples were skipped in epoch 0, more than max_skipped=2" in str(error)
    assert "3 load failed: a, b, c" in str(error) and "pipeline bug" not in str(error)
    assert str(error).rstrip().endswith("at least 8)")  # (the sentence whole)
    assert healing.skipped == {1: "a", 2: "b", 3: "c"}


def test_the_skip_limit_error_names_each_skip_by_its_kind_and_what_to_do() -> None:
    healing = _healing(on_error="skip", max_skipped=2)
    snapshot = view(1, Running(0), epoch=0)
    # (the kinds as the workers tell them: where each failure was caught)
    reasons = [
        (1, "s/00000.tar:000000005", "has no .txt member", False, wire.MEMBER_MISSING, "txt"),
        (2, "s/00003.tar:000030007", "[jpeg_parser] Invalid marker", True, wire.UNDECODABLE, ""),
        (3, "s/00002.tar:000020011", "has no .txt member", False, wire.MEMBER_MISSING, "txt"),
        (4, "7", "step raised KeyError: 'x'", True, wire.IN_STEP, ""),
        (
            5,
            "a.parquet, row group 0, row 3",
            "column 'caption' is null",
            False,
            wire.MEMBER_MISSING,
            "caption",
        ),
    ]
    for index, name, reason, inside, kind, member in reasons:
        message = wire.SamplesFailed(
            0, index, (index,), (name,), reason, exits=inside, kind=kind, member=member
        )
        healing.samples_failed(snapshot, message)
    assert (
        healing.delivered(batch(0, skipped=(1, 2), skipped_names=reasons_names(reasons, 0, 2)), 220)
        is None
    )
    error = healing.delivered(
        batch(1, skipped=(3, 4, 5), skipped_names=reasons_names(reasons, 2, 5)), 220
    )
    assert isinstance(error, SkipLimitError)
    text = str(error)
    assert text.startswith("5 samples were skipped in epoch 0, more than max_skipped=2:")
    assert (
        "3 member missing: s/00000.tar:000000005, s/00002.tar:000020011, "
        "a.parquet, row group 0, row 3" in text
    )
    assert "optional={'caption': b'', 'txt': b''}" in text and "ParquetDataset" in text
    assert "1 file undecodable: s/00003.tar:000030007" in text
    assert "1 exception in step: 7" in text
    assert "fix step()" in text
    assert "replace or remove it" in text and "raise max_skipped=" in text
    assert "pipeline bug" not in text


def test_samples_left_out_of_a_shard_truncated_since_indexed_do_not_count() -> None:
    """A shard found cut short by a read (S3 after the index command: no listing at the start)
    leaves its planned samples past the damage out, each skipped where it was planned: known
    lost data, as a damaged shard listed at the start is, so not against ``max_skipped``."""
    healing = _healing(on_error="skip", max_skipped=2)
    snapshot = view(1, Running(0), epoch=0)
    lost = tuple(range(10, 22))
    line = (  # (the shard's line, as the worker tells it)
        "s3://b/t-000002.tar was truncated since it was indexed: its first 4 samples are read; "
        "the rest of it is left out"
    )
    for index in lost:
        reason = f"load raised SampleLeftOut: s3://b/t-000002.tar: sample 's{index}' is left out"
        healing.samples_failed(
            snapshot,
            wire.SamplesFailed(
                0, 0, (index,), (f"t-2:{index}",), reason, exits=False, left_out=line
            ),
        )
    names = tuple(f"t-2:{index}" for index in lost)
    assert healing.delivered(batch(0, skipped=lost, skipped_names=names), 100) is None
    assert list(healing.left_out.values()) == [line]  # (one for the shard: stats().left_out)
    assert set(lost) <= set(healing.skipped)  # (still named as skipped)
    other = wire.SamplesFailed(0, 1, (30, 31, 32), ("a", "b", "c"), "load raised OSError", False)
    healing.samples_failed(snapshot, other)
    error = healing.delivered(batch(1, skipped=(30, 31, 32), skipped_names=("a", "b", "c")), 100)
    assert isinstance(error, SkipLimitError)
    assert str(error).startswith("3 samples were skipped in epoch 0, more than max_skipped=2:")


def reasons_names(
    reasons: list[tuple[int, str, str, bool, str, str]], first: int, last: int
) -> tuple[str, ...]:
    return tuple(reason[1] for reason in reasons[first:last])


def test_the_skip_count_starts_again_each_epoch_and_defaults_to_one_percent() -> None:
    healing = _healing()  # max_skipped=None: 1% of 1,000 samples = 10
    ten = tuple(range(10))
    assert healing.delivered(batch(0, skipped=ten, skipped_names=("x",) * 10), 1000) is None
    assert healing.delivered(batch(0, epoch=1, skipped=(20,), skipped_names=("y",)), 1000) is None
    assert healing.delivered(batch(1, epoch=1, skipped=ten, skipped_names=("z",) * 10), 1000)
    small = _healing()  # at least 8, however small the epoch
    eight = tuple(range(8))
    assert small.delivered(batch(0, skipped=eight, skipped_names=("x",) * 8), 10) is None


def test_waits_are_bounded_by_what_the_worker_does() -> None:
    healing = _healing(timeouts=Timeouts(10.0, 100.0, 300.0))
    assert healing.wait_limit(view(up=False)) == (300.0, "startup_timeout=300")
    tracing = view(target=Running(0), signature_pending=True)
    assert healing.wait_limit(tracing) == (100.0, "startup_timeout=100")
    running = view(target=Running(0), received=3)
    assert healing.wait_limit(running) == (10.0, "timeout=10")
    assert _healing(timeouts=Timeouts(None, None, 300.0)).wait_limit(running) == (None, "")


def test_a_replacement_gets_a_short_start_and_twice_its_last_trace() -> None:
    healing = _healing(timeouts=Timeouts(10.0, 100.0, 300.0))
    handle = FakeHandle(0, shard(0))
    traced = WorkerCounters(trace_seconds=[4.0])
    healing.started(view(handle=handle, counters=traced))
    starting = view(handle=handle, up=False, counters=traced)
    assert healing.wait_limit(starting)[0] == min(300.0, max(10.0, REPLACEMENT_START))
    tracing = view(handle=handle, signature_pending=True, counters=traced)
    assert healing.wait_limit(tracing)[0] == 18.0  # 10 + 2 x 4
    # once it traced (one more trace counted), or another process: the usual limits
    again = WorkerCounters(trace_seconds=[4.0, 5.0])
    assert healing.wait_limit(view(handle=handle, signature_pending=True, counters=again))[0] == 100
    other = view(signature_pending=True, counters=traced)
    assert healing.wait_limit(other)[0] == 100.0
