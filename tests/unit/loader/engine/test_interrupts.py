"""Interruptions without processes: the words of a stopped loader are never empty, and a batch
that an interruption kept from the user is counted or not, never half (see
tests/integration/test_interrupts.py for the real signals)."""

from __future__ import annotations

import pytest

from ipc import wire
from loader.engine._interrupts import is_interruption, reason
from loader.engine._session import Idle, WorkerSession
from loader.run._epochs import Epoch
from tests.unit.loader.engine.test_session import _Handle


@pytest.mark.parametrize(
    ("error", "words"),
    [
        (KeyboardInterrupt(), "interrupted by KeyboardInterrupt while waiting for batch 3"),
        (SystemExit(0), "interrupted by SystemExit (0) while waiting for batch 3"),
        (RuntimeError(), "RuntimeError"),
        (ValueError("bad sample"), "bad sample"),
    ],
)
def test_the_reason_is_never_empty(error: BaseException, words: str) -> None:
    assert reason(error, "waiting for batch 3") == words
    assert reason(error, "")


def test_interruptions_are_what_is_not_an_exception() -> None:
    assert is_interruption(KeyboardInterrupt()) and is_interruption(SystemExit(1))
    assert not is_interruption(RuntimeError()) and not is_interruption(StopIteration())


def _batch(step: int, random: bytes) -> wire.BatchReady:
    return wire.BatchReady(0, step, 0, step % 2, 1, (), 0, 0, 0, 0, random=random)


def _counted(session: WorkerSession) -> tuple[int, bytes]:
    view = session.view()
    return view.delivered, view.random


def test_a_batch_taken_back_is_uncounted_once_and_only_if_counted() -> None:
    session = WorkerSession(_Handle())  # type: ignore[arg-type]
    session.go(Idle(0), up=True)
    session.start_epoch(0, base_step=5)  # a resumed epoch: its first batch is step 5
    first, second = _batch(0, b"after-0"), _batch(1, b"after-1")
    session.handed_out(first)
    assert _counted(session) == (1, b"after-0")
    session.take_back(second)  # not counted yet: nothing to undo
    assert _counted(session) == (1, b"after-0")
    session.handed_out(second)
    session.take_back(second)
    assert _counted(session) == (1, b"after-0")
    session.take_back(second)  # (twice: still once)
    assert _counted(session) == (1, b"after-0")


def test_an_epoch_takes_back_its_last_batch_and_is_not_over() -> None:
    epoch = Epoch(0)
    epoch.begin(0, expected=2, first_step=3)
    epoch.handed_out()
    epoch.take_back(4)  # step 4 was not counted: nothing changes
    assert epoch.delivered == 1 and not epoch.finished
    epoch.handed_out()
    assert epoch.finished and epoch.end_of_dataloader
    epoch.take_back(4)
    assert epoch.delivered == 1 and not epoch.finished and not epoch.end_of_dataloader
    assert epoch.next_step == 4
