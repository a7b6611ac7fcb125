"""What goes wrong in a worker, as the exception the trainer raises (:mod:`loader.engine.
_failures`), from snapshots whose process is a stand-in: which class, and a message that names
the worker, shard, epoch and step."""

from __future__ import annotations

import pytest

from ipc import wire
from loader.engine import _failures
from loader.engine._session import Running
from loader.errors import (
    AgreementError,
    StartupError,
    WorkerDiedError,
    WorkerError,
    WorkerTimeoutError,
)

from .fakes import FakeHandle, shard, view


def _failure(
    type_name: str = "ValueError", epoch: int | None = 2, step: int | None = 3
) -> wire.WorkerFailure:
    return wire.WorkerFailure(
        "builtins", type_name, "bad pixel", "Traceback...", epoch, step, "step"
    )


def test_a_relayed_failure_keeps_its_class_and_names_where_in_the_epochs_count() -> None:
    snapshot = view(1, Running(2), epoch=2, first_step=10)
    error = _failures.relayed(snapshot, _failure())
    assert type(error) is ValueError
    assert str(error) == "bad pixel [worker 1, shard 1/2, epoch 2, step 13, in step]"
    assert (error.worker, error.shard, error.epoch, error.step) == (1, 1, 2, 13)  # type: ignore[attr-defined]
    assert error.__cause__ is not None and "Traceback..." in str(error.__cause__)


def test_a_relayed_failure_of_another_epoch_keeps_its_own_step() -> None:
    error = _failures.relayed(view(0, Running(2), epoch=2, first_step=10), _failure(epoch=3))
    assert "epoch 3, step 3" in str(error)
    before = _failures.relayed(view(0, epoch=None), _failure(epoch=None, step=None))
    assert "before the first epoch" in str(before)


def test_an_unknown_class_arrives_as_a_worker_error_saying_why() -> None:
    failure = wire.WorkerFailure("no_such_module", "Oops", "boom", "tb", 0, 0, "source")
    error = _failures.relayed(view(), failure)
    assert isinstance(error, WorkerError) and error.remote_type == "no_such_module.Oops"
    assert "the trainer has not imported 'no_such_module'" in str(error)


def test_a_known_dali_message_gets_its_hint() -> None:
    failure = _failure()
    hinted = wire.WorkerFailure(
        "builtins", "RuntimeError", "Expected batch size 8, got 3", "tb", 0, 0, "step"
    )
    assert "Hint: an ExternalSource root must yield full batches" in str(
        _failures.relayed(view(), hinted)
    )
    assert "Hint" not in str(_failures.relayed(view(), failure))


def test_a_dead_worker_is_named_with_its_exit_and_its_last_step() -> None:
    handle = FakeHandle(1, shard(1), exitcode=-11, pid=4321)
    error, cause = _failures.died(
        view(1, Running(0), handle=handle, epoch=0, last_step=4, first_step=2)
    )
    assert isinstance(error, WorkerDiedError)
    assert (error.worker, error.pid, error.exitcode, error.signal_name) == (1, 4321, -11, "SIGSEGV")
    assert not error.out_of_memory
    assert "worker 1, shard 1/2, epoch 0" in str(error) and "last step sent 6" in str(error)
    assert "unexpectedly" in str(error)
    assert handle.exited and handle.process.joined  # reaped, marked
    assert "SIGSEGV" in cause


def test_a_dead_worker_shows_its_stack() -> None:
    stack = 'Current thread 0x1 (most recent call first):\n  File "a.py", line 3 in step\n'
    handle = FakeHandle(0, shard(0), exitcode=-6, stack=stack)
    error, cause = _failures.died(view(handle=handle))
    assert "--- worker stack (faulthandler) ---" in str(error) and "no batch yet" in str(error)
    assert 'File "a.py", line 3 in step' in cause


def test_an_out_of_memory_kill_is_named_with_the_step_it_was_making(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_failures.limits, "oom_kills", lambda: {"vmstat": 1})
    monkeypatch.setattr(_failures.limits, "memory_limit", lambda: None)
    handle = FakeHandle(0, shard(0), exitcode=-9, oom_kills_at_start={"vmstat": 0})
    snapshot = view(target=Running(1), handle=handle, epoch=1, last_step=2)
    error, _ = _failures.died(snapshot)
    assert isinstance(error, WorkerDiedError) and error.out_of_memory
    assert "out-of-memory killer (SIGKILL) while making step 3" in str(error)
    assert "the machine ran out of memory" in str(error)


def test_a_sigkill_without_an_out_of_memory_kill_is_not_called_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_failures.limits, "oom_kills", lambda: {})
    error, _ = _failures.died(view(handle=FakeHandle(0, shard(0), exitcode=-9)))
    assert isinstance(error, WorkerDiedError) and not error.out_of_memory
    assert "out-of-memory" not in str(error)


def test_a_silent_worker_times_out_naming_the_step_it_waited_for() -> None:
    snapshot = view(1, Running(4), epoch=4, first_step=20, received=5)
    error, cause = _failures.timed_out(snapshot, 7.0, "timeout=7")
    assert isinstance(error, WorkerTimeoutError)
    assert (error.worker, error.epoch, error.step) == (1, 4, 25)
    assert "sent nothing for 7 s while the trainer waited for a batch (timeout=7)" in str(error)
    assert "[worker 1, shard 1/2, epoch 4, step 25]" in str(error)
    assert "the worker's stack could not be read" in str(error)  # (no pid: never signalled)
    assert cause == "sent nothing for 7 s (timeout=7)"
    first = _failures.timed_out(view(target=Running(0), epoch=0), 7.0, "x")[0]
    assert "waited for its first batch" in str(first)


def test_a_replacement_that_times_out_says_what_it_was_doing() -> None:
    starting = wire.Starting("source", "scanning shards")
    snapshot = view(target=Running(0), up=False, epoch=0, starting=starting)
    error, _ = _failures.timed_out(snapshot, 5.0, "x")
    assert "; it was last" in str(error)


def test_a_worker_that_never_started_is_a_startup_error() -> None:
    error = _failures.not_started(view(up=False), 30.0)
    assert isinstance(error, StartupError)
    assert "did not start: it sent nothing for 30 s (startup_timeout)" in str(error)
    assert "it never said what it does" in str(error)


def _signature(batch_size: int = 8, captured: bool = True) -> wire.Signature:
    return wire.Signature(batch_size, "cpu", None, 2, (), "dict", captured, True, "1.0", 1.5)


def test_workers_that_traced_different_loops_disagree() -> None:
    views = [view(0, signature=_signature()), view(1, signature=_signature(batch_size=4))]
    error, fell_back = _failures.disagreement(views)
    assert isinstance(error, AgreementError) and fell_back == []
    assert "worker 1 (shard 1/2" in str(error)
    assert "disagrees with worker 0 on batch_size: 4 != 8" in str(error)


def test_agreeing_workers_name_those_that_fell_back_to_eager() -> None:
    eager = _signature(captured=False)
    views = [view(0, signature=eager), view(1), view(1, signature=eager)]
    assert _failures.disagreement(views) == (None, ["0 (shard 0/2)", "1 (shard 1/2)"])
    assert _failures.disagreement([view(0, signature=_signature())]) == (None, [])
    assert _failures.disagreement([view(0), view(1)]) == (None, [])  # nothing signed yet
