"""num_workers="auto" with real workers: the layout changes only at an epoch boundary, every
epoch still delivers every sample exactly once, the memory budget holds, and under torchrun
two ranks agree on every layout."""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from loader import Loader
from tests import timing_pipelines as T

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]
BATCH = 8
TOTAL = BATCH * 80 + 4  # padded: an epoch's length depends on the layout (82 batches on 2
# workers, 84 on 4), so len(loader) must already count the next epoch's layout


def _sleeping(total: int = TOTAL, seconds: float = 0.002) -> Any:
    """Input-bound on purpose, off the CPU: more workers than CPUs help."""
    return functools.partial(T.sleeping_source, total=total, batch_size=BATCH, seconds=seconds)


def _epoch(loader: Loader) -> tuple[list[int], set[int], int]:
    """One epoch: the real ids received, the workers that made them, the batches."""
    ids: list[int] = []
    workers: set[int] = set()
    batches = 0
    for batch in loader:
        real = BATCH - batch.info.padded
        ids.extend(int(i) for i in batch["id"][:real].ravel())
        workers.add(batch.info.worker)
        batches += 1
        del batch
    return ids, workers, batches


def test_auto_changes_the_layout_at_an_epoch_boundary_and_keeps_every_epoch_exactly_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="loader")
    layouts, pids = [], []
    with Loader(_sleeping(), T.id_step, batch_size=BATCH, num_workers="auto") as loader:
        assert loader.stats().autotune is not None
        first = loader.num_workers
        for _ in range(4):
            length = len(loader)
            layouts.append(loader.num_workers)
            ids, workers, batches = _epoch(loader)
            pids.append(loader.worker_pids())
            assert sorted(ids) == list(range(TOTAL)), "not every sample exactly once"
            assert batches == length, "len(loader) did not count this epoch's layout"
            # every batch of an epoch came from the layout it started with
            assert workers == set(range(layouts[-1]))
        layouts.append(loader.num_workers)
        report = loader.stats().autotune
    assert report is not None
    assert layouts[0] == first
    # a load that sleeps: more workers are faster, so the first guess was left for more
    assert max(layouts) > first, report
    assert report.trials[0].layout.workers == first
    assert (
        max(t.batches_per_second for t in report.trials[1:]) > report.trials[0].batches_per_second
    )
    assert report.settled and report.layout.workers == layouts[-1]
    assert report.reason.startswith("settled on")
    changed = [
        r.getMessage() for r in caplog.records if "num_workers='auto': epoch" in r.getMessage()
    ]
    assert changed and "trying" in changed[0]
    # the workers of a left layout are gone
    left = [pid for epoch_pids in pids[:-1] for pid in epoch_pids if pid not in pids[-1]]
    assert left
    assert not any(psutil.pid_exists(pid) and _alive(pid) for pid in left)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _uss(pids: list[int]) -> list[int]:
    return [int(psutil.Process(pid).memory_full_info().uss) for pid in pids]


def test_the_memory_budget_is_respected() -> None:
    # spawned workers: a forked one's USS grows as its server's pages stop being shared with it,
    # so two forked loaders of one pipeline can differ twofold; a spawned one's is its own
    # what one worker of this pipeline holds
    with Loader(
        _sleeping(seconds=0.0002), T.id_step, batch_size=BATCH, num_workers=1, start_method="spawn"
    ) as one:
        _epoch(one)
        single = max(_uss(one.worker_pids()))
    limit = int(1.5 * single)  # room for one worker, not for two
    with Loader(
        _sleeping(seconds=0.0002),
        T.id_step,
        batch_size=BATCH,
        num_workers="auto",
        memory_limit=limit,
        start_method="spawn",
    ) as loader:
        for _ in range(3):
            ids, workers, _batches = _epoch(loader)
            assert sorted(ids) == list(range(TOTAL))
            assert workers == {0}
            assert sum(_uss(loader.worker_pids())) <= limit
        report = loader.stats().autotune
    assert report is not None and report.memory_limit == limit
    assert report.layout.workers == 1
    assert all(trial.memory <= limit for trial in report.trials)
    assert "memory budget" in report.reason or report.trials, report


def test_auto_under_torchrun_two_ranks_agree(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env["PYTHONPATH"] = str(ROOT)
    env["OMP_NUM_THREADS"] = "1"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(ROOT / "tests" / "integration" / "autotune_job.py"),
        str(tmp_path),
    ]
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=200, check=False
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    epochs = len(records[0]["epochs"])
    assert epochs == 3
    for epoch in range(epochs):
        seen = [record["epochs"][epoch] for record in records]
        assert seen[0]["workers"] == seen[1]["workers"], "the ranks ran different layouts"
        assert seen[0]["steps"] == seen[1]["steps"], "the ranks took different step counts"
        assert seen[0]["steps"] == seen[0]["len"]
        everything = sorted(seen[0]["ids"] + seen[1]["ids"])
        assert everything == list(range(records[0]["total"])), "not exactly once"
    layouts = [e["workers"] for e in records[0]["epochs"]]
    assert len(set(layouts)) > 1, layouts
    assert records[0]["report"] == records[1]["report"]
    assert "num_workers='auto': epoch" in output


def test_a_state_resumes_on_its_own_layout_exactly() -> None:
    with Loader(_sleeping(), T.id_step, batch_size=BATCH, num_workers="auto") as loader:
        first = loader.num_workers
        _epoch(loader)
        length = len(loader)  # the next layout starts here
        saved_on = loader.num_workers
        before: list[int] = []
        for batch in loader:
            before.extend(int(i) for i in batch["id"][: BATCH - batch.info.padded].ravel())
            del batch
            if len(before) >= BATCH * (length // 2):
                break
        state = loader.state_dict()
    assert saved_on != first  # (a sleeping load: more workers were tried)
    with Loader(_sleeping(), T.id_step, batch_size=BATCH, num_workers="auto") as resumed:
        assert resumed.num_workers == first
        resumed.load_state_dict(state)
        assert resumed.num_workers == saved_on
        report = resumed.stats().autotune
        assert report is not None and "state resumed from" in report.reason
        after, _workers, _batches = _epoch(resumed)
        assert sorted(before + after) == list(range(TOTAL))
        # the epoch after goes on whole
        ids, _workers, _batches = _epoch(resumed)
        assert sorted(ids) == list(range(TOTAL))
