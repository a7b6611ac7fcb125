"""The logger hooks of examples/: the TensorBoard hook's scalars, and the Lightning callback in a
real Lightning run (its CSV logger's metrics file)."""

from __future__ import annotations

import csv
import functools
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from loader import Loader
from tests import timing_pipelines as T

pytestmark = pytest.mark.timeout(240)
ROOT = Path(__file__).resolve().parents[2]
RATES = {
    "loader/waiting",
    "loader/batches_per_second",
    "loader/worker_load",
    "loader/worker_dali",
    "loader/worker_blocked",
    "loader/worker_publish",
    "loader/worker_idle",
    "loader/worker_cpus",
}


def _example(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class ScalarLog:
    """What a SummaryWriter is given: (tag, value, step) of each add_scalar."""

    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []

    def add_scalar(self, tag: str, value: float, global_step: int) -> None:
        self.scalars.append((tag, value, global_step))


def test_the_tensorboard_hook_writes_the_rates_as_scalars() -> None:
    hook = _example("tensorboard_rates").log_loader_rates
    writer = ScalarLog()
    source = functools.partial(T.sleeping_source, total=160, batch_size=8, seconds=0.002)
    with Loader(source, T.id_step, batch_size=8, num_workers=2) as loader:
        for step, batch in enumerate(loader):
            del batch
            if step % 5 == 4:
                hook(writer, loader, step)
    assert {tag for tag, _, _ in writer.scalars} == RATES
    assert sorted({step for _, _, step in writer.scalars}) == [4, 9, 14, 19]
    last = {tag: value for tag, value, step in writer.scalars if step == 19}
    assert last["loader/waiting"] > 0.3  # the sleeping load: input-bound
    assert last["loader/worker_load"] > last["loader/worker_dali"]
    assert all(0 <= value <= 1.05 for tag, value in last.items() if "worker_" in tag)


def test_the_lightning_callback_logs_the_rates(tmp_path: Path) -> None:
    pytest.importorskip("pytorch_lightning")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env["PYTHONPATH"] = str(ROOT)
    command = [sys.executable, str(ROOT / "examples" / "lightning_rates.py")]
    command += ["--samples", "256", "--batch-size", "8", "--epochs", "2", "--every", "5"]
    command += ["--logdir", str(tmp_path)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    (metrics,) = tmp_path.glob("loader-rates/version_*/metrics.csv")
    rows = list(csv.DictReader(metrics.open()))
    logged = [row for row in rows if row.get("loader/waiting")]
    # 2 epochs of 256 / 8 = 32 steps each, the rates after the 5th, 10th, ... of each epoch
    # (logged at the global step after it)
    assert [int(row["step"]) for row in logged] == [5, 10, 15, 20, 25, 30] + [
        32 + s for s in (5, 10, 15, 20, 25, 30)
    ]
    assert set(rows[0]) >= RATES
    for row in logged:
        assert 0 <= float(row["loader/waiting"]) <= 1
        assert float(row["loader/batches_per_second"]) > 0
