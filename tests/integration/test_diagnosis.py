"""Per-stage timing, loader.diagnose() and the trace, with real workers: a pipeline made
input-bound on purpose (a load that sleeps) and one that is not (a trainer slower than it)."""

from __future__ import annotations

import functools
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from loader import Loader
from tests import timing_pipelines as T
from tests.integration.test_worker_server import run_python

pytestmark = pytest.mark.timeout(180)

BATCH = 8
SLEEP = 0.002  # per sample: 16 ms of load per batch, on a prefetch thread, off the CPU


def _sleeping(total: int = 2 * BATCH * 40) -> Any:
    return functools.partial(T.sleeping_source, total=total, batch_size=BATCH, seconds=SLEEP)


def _run(loader: Loader, epochs: int, train_seconds: float) -> list[tuple[int, int, int]]:
    """Iterate ``epochs`` epochs, "training" ``train_seconds`` per batch; the (worker, epoch,
    the worker's step) of every batch in the order received (what the trace's spans carry)."""
    seen = []
    for _ in range(epochs):
        for batch in loader:
            info = batch.info
            seen.append((info.worker, info.epoch, info.worker_step))
            del batch
            if train_seconds:
                time.sleep(train_seconds)
    return seen


def test_a_load_that_sleeps_is_input_bound_and_waits_on_io() -> None:
    # one worker: below the budget even where pytest-xdist peers share the CPUs (up to 2 workers
    # per CPU for a load that waits), so the advice is more workers
    with Loader(_sleeping(), T.id_step, batch_size=BATCH, num_workers=1) as loader:
        seen = _run(loader, 1, 0.0)
        stats = loader.stats(window=60)
        report = loader.diagnose(window=60)
    assert len(seen) == 80
    assert report.input_bound, str(report)
    assert report.waiting_fraction > 0.3, str(report)
    assert report.dominant_stage == "load", str(report)
    assert report.workers == "waiting on I/O", str(report)
    assert report.load_cpu_fraction is not None and report.load_cpu_fraction < 0.5
    assert "num_workers=" in report.suggestion and "load()" in report.suggestion
    assert str(report).startswith("input-bound: the trainer waited")
    # the totals: every batch's stages; load() ran >= 16 ms per batch on its thread
    assert sum(w.stages.batches for w in stats.workers) == 80
    for worker in stats.workers:
        assert worker.stages.read >= 0.9 * worker.stages.batches * BATCH * SLEEP
        assert worker.stages.read_cpu < 0.5 * worker.stages.read
        assert worker.stages.load > worker.stages.dali
    assert stats.trainer.batches == 81  # and the next() that ended the epoch
    assert stats.trainer.waiting > stats.trainer.training


def test_a_trainer_slower_than_its_input_is_not_input_bound() -> None:
    source = functools.partial(T.quick_source, total=2 * BATCH * 30, batch_size=BATCH)
    with Loader(source, T.id_step, batch_size=BATCH, num_workers=2) as loader:
        _run(loader, 1, 0.010)
        report = loader.diagnose(window=60)
        stats = loader.stats(window=60)
    assert not report.input_bound, str(report)
    assert report.waiting_fraction < 0.05, str(report)
    assert report.dominant_stage == "blocked", str(report)
    assert report.workers == "blocked on full slots", str(report)
    assert str(report).startswith("not input-bound")
    assert stats.recent_trainer.training >= 0.9 * 59 * 0.010
    for worker in stats.workers:
        assert worker.stages.blocked > worker.stages.dali
        assert 0 < worker.recent.batches <= worker.stages.batches


def test_too_few_batches_are_not_judged() -> None:
    with Loader(_sleeping(2 * BATCH * 2), T.id_step, batch_size=BATCH, num_workers=2) as loader:
        _run(loader, 1, 0.0)
        report = loader.diagnose()
    assert not report.input_bound
    assert report.verdict == "too little to judge"


def test_the_trace_holds_every_batch_span_by_span(tmp_path: Path) -> None:
    path = tmp_path / "loader-trace.json"
    with Loader(_sleeping(2 * BATCH * 12), T.id_step, batch_size=BATCH, trace=path) as loader:
        seen = _run(loader, 2, 0.001)
        pids = loader.worker_pids()
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names[0] == "trainer"
    assert [names[1], names[2]] == [f"worker {w} (shard {w}/2, pid {pids[w]})" for w in range(2)]
    spans = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] >= 0 for e in spans)
    by_track: dict[int, list[dict[str, Any]]] = defaultdict(list)
    starts: dict[int, dict[str, dict[str, Any]]] = defaultdict(dict)
    for span in spans:
        if span["cat"] == "start":  # (a worker's once; the server may prepare twice: the latest)
            assert span["tid"] == 3 or span["name"] not in starts[span["tid"]]
            starts[span["tid"]][span["name"]] = span
        else:
            by_track[span["tid"]].append(span)
    _check_starts(names, starts, by_track)

    # the trainer: one next() per batch received and one per epoch's end, in order
    calls = [s for s in by_track[0] if s["name"] == "next"]
    received = [(s["args"]["worker"], s["args"]["epoch"], s["args"]["step"]) for s in calls]
    assert [r for r in received if r[2] >= 0] == seen
    assert [r for r in received if r[2] < 0] == [(-1, 0, -1), (-1, 1, -1)]
    trains = [s for s in by_track[0] if s["name"] == "train"]
    assert len(trains) == len(calls) - 1
    assert sum(s["dur"] >= 1000 for s in trains) >= len(seen) - 1  # the 1 ms "training"
    left = {(s["args"]["worker"], s["args"]["epoch"], s["args"]["step"]): s for s in calls}

    for worker in range(2):
        track = sorted(by_track[worker + 1], key=lambda s: s["ts"])
        batches: dict[tuple[int, int], dict[str, dict[str, Any]]] = defaultdict(dict)
        for span in track:
            assert span["name"] in ("idle", "load", "dali", "blocked", "publish")
            batches[(span["args"]["epoch"], span["args"]["step"])][span["name"]] = span
        # exactly the batches this worker made, each with its stages back to back
        assert sorted(batches) == sorted((e, s) for w, e, s in seen if w == worker)
        previous_end = None
        for key in sorted(batches, key=lambda k: batches[k]["dali"]["ts"]):
            stages = batches[key]
            load, dali, publish = stages["load"], stages["dali"], stages["publish"]
            assert load["dur"] > 0 and load["args"]["read_ms"] >= 0
            assert dali["ts"] == pytest.approx(load["ts"] + load["dur"], abs=0.01)
            after = stages.get("blocked", dali)
            if "blocked" in stages:
                assert after["ts"] == pytest.approx(dali["ts"] + dali["dur"], abs=0.01)
            assert publish["ts"] == pytest.approx(after["ts"] + after["dur"], abs=0.01)
            end = publish["ts"] + publish["dur"]
            if previous_end is not None:
                assert load["ts"] >= previous_end - 0.01  # one batch after another
            previous_end = end
            # published before the trainer's next() returned it (one clock for all processes)
            call = left[(worker, *key)]
            assert end <= call["ts"] + call["dur"] + 0.01
        # the load the trainer waited on is the sleeping load: >= 16 ms of it per batch
        read = sum(s["args"]["read_ms"] for s in track if s["name"] == "load")
        assert read >= 0.9 * len(batches) * BATCH * SLEEP * 1000


def _check_starts(
    names: dict[int, str],
    starts: dict[int, dict[str, dict[str, Any]]],
    by_track: dict[int, list[dict[str, Any]]],
) -> None:
    """Each worker's start on its track (its process, then its sources, before its first
    batch), and what the worker server did for this loader on a track after the workers'."""
    assert names[3] == "worker server"
    assert set(starts) == {1, 2, 3}
    prepared = starts[3]["the loader's modules"]  # (its latest: just before the forks)
    for tid in (1, 2):
        began, sources = starts[tid]["worker start"], starts[tid]["sources"]
        assert began["ts"] >= prepared["ts"] + prepared["dur"] - 0.01  # forked after it
        assert sources["ts"] >= began["ts"] + began["dur"] - 0.01
        first = min(s["ts"] for s in by_track[tid] if s["name"] == "dali")
        assert sources["ts"] + sources["dur"] <= first + 0.01
        assert sources["dur"] > 0


def test_save_trace_keeps_the_last_seconds(tmp_path: Path) -> None:
    source = functools.partial(T.quick_source, total=2 * BATCH * 10, batch_size=BATCH)
    with Loader(source, T.id_step, batch_size=BATCH, num_workers=2) as loader:
        _run(loader, 1, 0.0)
        time.sleep(0.3)
        _run(loader, 1, 0.0)
        whole = json.loads(loader.save_trace(tmp_path / "all.json").read_text())
        last = json.loads(loader.save_trace(tmp_path / "last.json", seconds=0.2).read_text())
        with pytest.raises(ValueError, match="seconds"):
            loader.save_trace(tmp_path / "x.json", seconds=0)

    def epochs(trace: dict[str, Any]) -> set[int]:
        return {
            e["args"]["epoch"]
            for e in trace["traceEvents"]
            if e["ph"] == "X" and e["cat"] != "start"
        }

    assert epochs(whole) == {0, 1}
    assert epochs(last) == {1}


def test_a_trace_path_in_a_missing_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        Loader(_sleeping(), T.id_step, batch_size=BATCH, trace=tmp_path / "no" / "t.json")
    with pytest.raises(TypeError, match="file path"):
        Loader(_sleeping(), T.id_step, batch_size=BATCH, trace=3)  # type: ignore[arg-type]


START_SCRIPT = """
import json, sys
import numpy as np
from loader import Loader, sharded_source

def sample(index):
    return np.array([index], dtype=np.int64)

def source(shard):
    return sharded_source(shard, 32, sample, 8)

def step(ids):  # (DALI imported here only: the trainer never imports it)
    import nvidia.dali.experimental.dynamic as ndd
    return {"id": ndd.cast(ids, dtype=ndd.int64)}

if __name__ == "__main__":
    with Loader(source, step, batch_size=8, num_workers=2) as loader:
        for batch in loader:
            pass
        loader.save_trace(sys.argv[1])
"""


def test_the_trace_shows_where_a_start_right_after_the_imports_went(tmp_path: Path) -> None:
    """A script that makes its loader right after ``import loader``: the worker server forked
    at that import is still importing DALI, and the trace shows it, then the workers' own
    start and sources, before their first batch."""
    script = tmp_path / "start_script.py"
    script.write_text(START_SCRIPT)
    trace = tmp_path / "start.json"
    run_python(tmp_path, str(script), str(trace), timeout=150)
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    starts = {(e["tid"], e["name"]): e for e in events if e.get("cat") == "start"}
    assert names[3] == "worker server"
    server = [name for tid, name in sorted(starts, key=lambda k: starts[k]["ts"]) if tid == 3]
    assert server[0] == "import DALI" and "the loader's modules" in server, server
    dali = starts[(3, "import DALI")]
    assert dali["ts"] >= 0 and dali["dur"] > 50_000  # (µs: DALI's import takes ~1 s here)
    dali_end = dali["ts"] + dali["dur"]
    for tid in (1, 2):
        began, sources = starts[(tid, "worker start")], starts[(tid, "sources")]
        assert began["ts"] >= dali_end - 10  # forked once the server had DALI
        assert sources["ts"] >= began["ts"]
        first = min(e["ts"] for e in events if e["tid"] == tid and e["name"] == "dali")
        assert sources["ts"] + sources["dur"] <= first + 10
