"""The capture-mode execution model, rule by rule, through Loader with real workers.

Each test's docstring names the rule (see the team's EXECUTION_MODEL.md) it checks.
"""

from __future__ import annotations

import functools
import logging
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loader import Loader
from tests import pipelines as P
from tests.pipelines import ids_of, reader

pytestmark = pytest.mark.timeout(120)


# ------------------------------------------------------------------------------------- rule 1
def test_rule1_trace_once_then_replay_every_epoch(image_root: Path) -> None:
    """Rule 1: the first step is traced; later steps and epochs replay the built pipeline."""
    with Loader(reader(image_root), P.decode_step, batch_size=4, copy=True) as loader:
        for _ in range(3):
            assert sorted(i for b in loader for i in ids_of(b)) == list(range(48))
        stats = loader.stats()
    assert [w.traces for w in stats.workers] == [1, 1]
    assert all(len(w.trace_seconds) == 1 for w in stats.workers)


def test_rule1_nothing_captured_warns_once_and_runs_eagerly() -> None:
    """Rule 1: a body with no DALI operator warns (once, in the trainer) and still works."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Loader(P.id_source, P.passthrough_step, batch_size=4, copy=True) as loader:
            for _ in range(2):
                assert sorted(i for b in loader for i in ids_of(b)) == list(range(64))
    fallbacks = [w for w in caught if "no operators were captured" in str(w.message)]
    assert len(fallbacks) == 1 and fallbacks[0].category is UserWarning


def test_rule1_unimportable_step_is_refused_before_start() -> None:
    """Rule 1: a body DALI cannot read the source of (lambda, REPL) is refused up front."""
    with pytest.raises(TypeError, match="lambda"):
        Loader(P.id_source, lambda ids: {"id": ids}, batch_size=4)


# ------------------------------------------------------------------------------------- rule 2
def test_rule2_source_is_polled_ahead_of_the_body() -> None:
    """Rule 2: the captured pipeline prefetches: the root was polled ahead of each step's body."""
    with Loader(P.counting_source, P.prefetch_probe_step, batch_size=2, num_workers=1) as loader:
        for _ in range(2):
            polled = [(b.info.step, int(b["polled"][0, 0])) for b in loader]
        # the second epoch is fully captured: step k's body runs after k + 2 source items
        assert all(count >= 6 + step + 2 for step, count in polled[:-1])


def test_rule2_a_sharded_source_prefetches_across_epochs(tmp_path: Path) -> None:
    """Rule 2 across epochs: a sharded_source root (no feeders) runs one capture loop over every
    epoch, so each worker loads the next epoch's first batch (and DALI starts on it) before the
    trainer starts that epoch, as DALI does for a reader; no sample is loaded twice."""
    source = functools.partial(P.logged_source, log_dir=str(tmp_path))
    delivered: dict[int, list[int]] = {0: [], 1: []}
    firsts: dict[int, list[int]] = {}
    with Loader(source, P.cast_step, batch_size=4, num_workers=2, copy=True) as loader:
        pids = loader.worker_pids()
        for batch in loader:  # epoch 0: 8 samples, 2 batches per worker
            delivered[batch.info.worker] += ids_of(batch)
        deadline = time.monotonic() + 30
        while not all(len(P.logged_loads(tmp_path, pid)) >= 8 + 4 for pid in pids):
            assert time.monotonic() < deadline, "no worker loaded the next epoch's first batch"
            time.sleep(0.05)
        early = [P.logged_loads(tmp_path, pid) for pid in pids]
        for batch in loader:
            firsts.setdefault(batch.info.worker, ids_of(batch))
            delivered[batch.info.worker] += ids_of(batch)
        stats = loader.stats()
    for worker, pid in enumerate(pids):
        assert early[worker][8:12] == firsts[worker]
        assert P.logged_loads(tmp_path, pid)[:16] == delivered[worker]  # once each, in order
    assert [w.traces for w in stats.workers] == [1, 1]


# ------------------------------------------------------------------------------------- rule 3
@pytest.mark.parametrize(
    "kind", ["external_source", "plain_reader", "reader_with_feeder", "reader_with_random"]
)
def test_rule3_rule12_break_then_next_epoch_is_complete(
    kind: str, image_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Rules 3 and 12: breaking out of an epoch leaves the next one complete and exactly-once,
    whether DALI kept the source usable (ExternalSource root, plain reader) or destroyed the
    reader (reader with a feeder or with captured random operators); workers rebuild and log."""
    source: Any = reader(image_root)
    feeders = None
    total = 48
    if kind == "external_source":
        source, step, total = P.id_source, P.cast_step, 64
    elif kind == "plain_reader":
        step = P.plain_reader_step
    elif kind == "reader_with_feeder":
        step, feeders = P.reader_feeder_step, P.offset_feeders
    else:
        step = P.random_step
    caplog.set_level(logging.INFO, logger="loader")
    with Loader(source, step, batch_size=4, feeders=feeders, copy=True) as loader:
        for i, _batch in enumerate(loader):
            if i == 3:
                break
        second = [i for b in loader for i in ids_of(b)]
        third = [i for b in loader for i in ids_of(b)]
        rebuilds = [w.rebuilds for w in loader.stats().workers]
    assert sorted(second) == list(range(total))
    assert sorted(third) == list(range(total))
    assert rebuilds == [1, 1]
    assert any("rebuilt its source" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------------------------- rule 4
def test_rule4_feeders_are_fresh_per_worker_and_read_once_per_step() -> None:
    """Rule 4: feeders(shard) builds each worker's own set; each is read once per step."""
    with Loader(
        P.id_source, P.feeder_step, feeders=P.offset_feeders, batch_size=4, copy=True
    ) as loader:
        batches = list(loader)
    for worker in (0, 1):
        offsets = [int(b["offset"][0, 0]) for b in batches if b.info.worker == worker]
        assert offsets == [1000 * worker + i for i in range(8)]


@pytest.mark.parametrize(
    ("step", "feeders", "source", "message"),
    [
        (P.late_feeder_step, P.offset_feeders, P.id_source, "wasn't seen during tracing"),
        (P.skipping_feeder_step, P.offset_feeders, P.id_source, "not consumed this step"),
        (P.double_feeder_step, P.offset_feeders, P.id_source, "only once per capture-mode step"),
        (P.feeder_step, P.shared_feeders, P.shared_root_source, "already used"),
        (P.feeder_step, P.short_feeders, P.id_source, "exhausted before the iteration ended"),
    ],
    ids=["4a-first-use-late", "4b-skipped", "4b-read-twice", "4c-shared", "4d-exhausted"],
)
def test_rule4_feeder_violations_raise_runtime_error(
    step: Any, feeders: Any, source: Any, message: str
) -> None:
    """Rule 4 a-d: each feeder violation reaches the trainer as RuntimeError with DALI's text."""
    with Loader(source, step, feeders=feeders, batch_size=4, copy=True) as loader:
        with pytest.raises(RuntimeError, match=message) as info:
            list(loader)
    assert "worker " in str(info.value) and "epoch 0" in str(info.value)


def test_rule4c_feeder_instances_are_refused() -> None:
    """Rule 4c: an instance (or a dict of them) cannot be shared by workers: refused up front."""
    import nvidia.dali.experimental.dynamic as ndd

    instance = ndd.ExternalSource([np.zeros(1)])
    with pytest.raises(TypeError, match="ExternalSource instance"):
        Loader(P.id_source, P.feeder_step, feeders=instance, batch_size=4)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not a dict of instances"):
        Loader(P.id_source, P.feeder_step, feeders={"offset": instance}, batch_size=4)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------- rule 5
def test_rule5_external_source_locks_to_its_first_use() -> None:
    """Rule 5: an ExternalSource called directly can never drive a capture loop."""
    with Loader(P.eagerly_used_source, P.cast_step, batch_size=4) as loader:
        with pytest.raises(RuntimeError, match="already used eagerly"):
            list(loader)


# ------------------------------------------------------------------------------------- rule 6
def test_rule6_conflicting_operator_batch_size() -> None:
    """Rule 6: an operator with a conflicting explicit batch_size raises DALI's RuntimeError."""
    with Loader(P.id_source, P.batch_size_step, batch_size=4) as loader:
        with pytest.raises(RuntimeError, match=r"Cannot change batch size to 7[\s\S]*step 1"):
            list(loader)


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_rule6_invalid_batch_size_is_refused_before_start(bad: Any) -> None:
    """Rule 6: capture needs an explicit, valid batch size; checked before any worker starts."""
    with pytest.raises(ValueError, match="batch_size"):
        Loader(P.id_source, P.cast_step, batch_size=bad)


def test_rule6_every_epoch_uses_the_same_batch_size() -> None:
    """Rule 6: every epoch of every worker delivers batches of the one batch size."""
    with Loader(P.id_source, P.cast_step, batch_size=4, copy=True) as loader:
        shapes = {b["id"].shape for _ in range(2) for b in loader}
    assert shapes == {(4, 1)}


# ------------------------------------------------------------------------------------- rule 7
def test_rule7_device_switch_on_a_later_step_raises() -> None:
    """Rule 7: an operator given another device on a later step raises a RuntimeError.

    DALI checks the device of a captured call site; without a GPU the GPU call itself may fail
    first (a CUDA RuntimeError). Either way the trainer gets a RuntimeError naming the step.
    """
    with Loader(P.id_source, P.device_switch_step, batch_size=4, num_workers=1) as loader:
        with pytest.raises(RuntimeError, match=r"(Cannot change device|CUDA)[\s\S]*step 2"):
            list(loader)


# ------------------------------------------------------------------------------------- rule 8
def test_rule8_one_eval_context_per_worker_for_every_epoch() -> None:
    """Rule 8: each worker builds one EvalContext and passes it every epoch, also after a break
    and a rebuild: no worker constructs a second one; its settings are agreed."""
    with Loader(
        P.context_counting_source, P.context_count_step, batch_size=4, num_threads=2, copy=True
    ) as loader:
        made: list[int] = []
        for epoch in range(4):
            seen: list[int] = []
            for batch in loader:
                seen += ids_of(batch)
                made += [int(v) for v in np.asarray(batch["contexts"]).ravel()]
                if epoch == 1 and len(seen) == 8:
                    break  # the workers rebuild their sources and trace again
            if epoch != 1:
                assert sorted(seen) == list(range(64))
        assert made and set(made) == {0}, f"EvalContexts made after the worker's own: {made}"
        coordinator = loader._run.require()
        assert coordinator is not None and coordinator.reference is not None
        assert coordinator.reference.num_threads == 2


# ------------------------------------------------------------------------------------- rule 9
def test_rule9_reader_used_eagerly_cannot_be_captured(image_root: Path) -> None:
    """Rule 9: a reader iterated eagerly in source() cannot switch to capture mode."""
    source = functools.partial(P.eager_then_capture_reader, root=str(image_root))
    with Loader(source, P.plain_reader_step, batch_size=4) as loader:
        with pytest.raises(RuntimeError, match="cannot switch to capture mode") as info:
            list(loader)
    assert "Hint" in str(info.value)


# ------------------------------------------------------------------------------------ rule 10
def test_rule10_nested_capture_loop_raises() -> None:
    """Rule 10: one capture loop per thread: a body that starts another one gets DALI's error."""
    with Loader(P.id_source, P.nested_loop_step, batch_size=4) as loader:
        with pytest.raises(RuntimeError, match="Only one capture-mode loop"):
            list(loader)


# ------------------------------------------------------------------------------------ rule 11
def test_rule11_checkpointing_reader_is_not_implemented(image_root: Path) -> None:
    """Rule 11: no checkpointing with capture: DALI's NotImplementedError, with a hint."""
    source = functools.partial(P.checkpointing_reader, root=str(image_root))
    with Loader(source, P.plain_reader_step, batch_size=4) as loader:
        with pytest.raises(NotImplementedError, match="Checkpointing") as info:
            list(loader)
    assert "enable_checkpointing" in str(info.value)


# --------------------------------------------------------------------- full batches helper
@pytest.mark.parametrize("drop_last", [False, True])
def test_sharded_source_gives_full_batches_and_flags_padding(drop_last: bool) -> None:
    """ExternalSource roots need full batches: sharded_source pads (flagged) or drops."""
    source = functools.partial(P.sample_source, total=30, batch_size=4, drop_last=drop_last)
    with Loader(source, P.cast_step, batch_size=4, copy=True) as loader:
        for _ in range(2):
            real: list[int] = []
            steps = {0: 0, 1: 0}
            for batch in loader:
                assert batch["id"].shape == (4, 1)
                steps[batch.info.worker] += 1
                ids = ids_of(batch)
                real += ids[: len(ids) - batch.info.padded]
            # the rank's batches shared out whole: the last worker may have one more
            assert steps[0] + steps[1] == len(loader) and steps[1] - steps[0] in (0, 1)
            if drop_last:
                assert len(real) == len(set(real)) == 28  # 7 full batches: 4 + 3
            else:
                assert sorted(real) == list(range(30))
