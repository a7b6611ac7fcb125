"""A sample whose ``load`` hangs or raises: found like a failing one, skipped or named, logged
once for all workers and epochs."""

from __future__ import annotations

import functools
import logging
import os
import signal
import time
from typing import Any

import numpy as np
import pytest

from ipc import wire
from loader import Loader, Shard, WorkerTimeoutError
from tests import pipelines as P
from workers import BatchedSamples

pytestmark = pytest.mark.timeout(120)

TIMEOUT = 2  # seconds per batch (a replacement's first batch: plus twice its first trace)
#: a replacement forked from a server that imported DALI starts in a fraction of a second (not
#: the 2-4 s a spawned one takes on a busy 2-core machine): keeps these tests short
FAST_RESTART = "forkserver"


def real_ids(batch: Any) -> list[int]:
    ids = [int(v) for v in np.asarray(batch["id"]).ravel()]
    keep = len(ids) - batch.info.padded
    return [i for row, i in enumerate(ids[:keep]) if row not in batch.info.replaced]


def plan(worker: int, epoch: int) -> list[list[int]]:
    """The sample ids of each batch of ``worker``'s shard in ``epoch`` (64 ids, batches of 4,
    2 workers, seed 0: the sources of these tests)."""
    shard = Shard.make(rank=0, world_size=1, worker=worker, num_workers=2, seed=0)
    batches = BatchedSamples(shard, 64, int, 4).batches_for_epoch(epoch)
    return [[int(i) for i in chunk] for chunk, _ in batches]


def hanging_sample() -> tuple[int, int]:
    """A sample of worker 0's shard in epoch 0, at its batch 4 or later, that is late in worker
    1's shard in epoch 1 (past what it loads before it hears of the sample); and that batch of
    worker 0. (A worker's traced first batch is bounded by startup_timeout, not timeout; from
    batch 4 on, a few batches of worker 0 are delivered before it hangs, so its replacement
    starts mid-epoch and counts its steps from there.)"""
    late = {i for chunk in plan(1, 1)[4:] for i in chunk}
    for step, chunk in enumerate(plan(0, 0)):
        found = [i for i in chunk if i in late]
        if step >= 4 and found:
            return found[0], step
    raise AssertionError("no such sample")


def test_a_hanging_sample_is_skipped_and_the_epoch_completes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sample, _step = hanging_sample()
    caplog.set_level(logging.WARNING, logger="loader")
    source = functools.partial(P.hanging_source, at=sample)
    with Loader(
        source,
        P.cast_step,
        batch_size=4,
        num_workers=2,
        copy=True,
        on_error="skip",
        timeout=TIMEOUT,
        max_restarts=2,
        startup_timeout=60,
        start_method=FAST_RESTART,
    ) as loader:
        for epoch in range(2):  # in epoch 1 the sample is worker 1's: it was told, not stuck
            started = time.monotonic()
            ids: list[int] = []
            reported: list[int] = []
            for batch in loader:
                ids += real_ids(batch)
                reported += batch.info.skipped
            assert sorted(ids) == [i for i in range(64) if i != sample], f"epoch {epoch}"
            assert reported == [sample], f"epoch {epoch}"  # its row was filled in
            if epoch == 0:  # one timeout and one restart, not startup_timeout (60 s)
                assert time.monotonic() - started < 40
        stats = loader.stats()
    assert stats.restarts == 1
    assert [index for index, _ in stats.skipped] == [sample]
    skipped = [r.getMessage() for r in caplog.records if "skipped sample" in r.getMessage()]
    assert len(skipped) == 1, skipped
    assert f"skipped sample {sample}: worker 0" in skipped[0] and "load() hangs" in skipped[0]


def test_a_hanging_sample_is_named_when_the_restarts_are_spent() -> None:
    sample, step = hanging_sample()
    source = functools.partial(P.hanging_source, at=sample)
    with Loader(
        source,
        P.cast_step,
        batch_size=4,
        num_workers=2,
        copy=True,
        timeout=TIMEOUT,
        max_restarts=1,
        startup_timeout=60,
        start_method=FAST_RESTART,
    ) as loader:
        started = time.monotonic()
        with pytest.raises(WorkerTimeoutError) as info:
            for _batch in loader:
                pass
        elapsed = time.monotonic() - started
    error = info.value
    message = str(error)
    assert f"its load() hangs on sample {sample} " in message, message
    assert f"timeout={TIMEOUT}" in message, message
    assert "the restart budget (max_restarts=1) is spent" in message
    # the epoch's step the trainer waited for (the sample's batch, or the one before it when
    # DALI's prefetch asked for the next batch first), not the replacement's own step 0
    assert error.epoch == 0 and error.step in (step - 1, step), (error.step, step)
    assert f"epoch 0, step {error.step}]" in message
    # two waits of about TIMEOUT and one restart; never startup_timeout (60 s)
    assert elapsed < 40


def test_a_sample_whose_load_raises_is_logged_once_for_all_workers_and_epochs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Sample 37 is worker 0's in epoch 0 and worker 1's in epochs 1 and 2 (shuffled): worker 0
    reports it, the trainer logs it and tells worker 1, and worker 1's replacement (killed in
    epoch 2) starts knowing it."""
    caplog.set_level(logging.WARNING, logger="loader")
    with Loader(
        P.failing_37_source,
        P.cast_step,
        batch_size=4,
        num_workers=2,
        copy=True,
        on_error="skip",
        max_restarts=1,
        start_method=FAST_RESTART,
    ) as loader:
        for epoch in range(4):
            ids: list[int] = []
            for k, batch in enumerate(loader):
                ids += real_ids(batch)
                if epoch == 2 and k == 1:
                    os.kill(loader.worker_pids()[1], signal.SIGKILL)
            assert sorted(ids) == [i for i in range(64) if i != 37], f"epoch {epoch}"
        assert loader.stats().restarts == 1
        assert [index for index, _ in loader.stats().skipped] == [37]
    warned = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "sample 37" in r.getMessage()
    ]
    assert len(warned) == 1, warned
    assert warned[0].startswith("skipped sample 37: worker 0") and "OSError" in warned[0]


def test_the_load_in_progress_line_survives_any_file_name() -> None:
    name = '/data/a "b"\tc\nd/é.jpg'
    running = wire.LoadRunning(57, 2.04, name, 0, 3)
    frames = 'Thread 0x1 (most recent call first):\n  File "x.py", line 1 in _load\n\n'
    stack = frames + running.line()
    assert wire.LoadRunning.find(stack) == wire.LoadRunning(57, 2.0, name, 0, 3)
    assert wire.LoadRunning.find("Thread 0x1 (most recent call first):\n") is None
