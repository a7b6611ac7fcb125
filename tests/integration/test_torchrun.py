"""Real torchrun launches (CPU, gloo) of examples/train_ddp.py: coverage, equal steps, agreement."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_ddp.py"


@pytest.fixture(scope="module")
def ddp_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from loader.sample import write_sample_dataset

    return write_sample_dataset(tmp_path_factory.mktemp("ddp"), count=50, classes=3, seed=2)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env["PYTHONPATH"] = str(ROOT)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _launch(launcher_args: list[str], script_args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *launcher_args, str(SCRIPT), *script_args],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(proc: subprocess.Popen[str], timeout: float = 180) -> tuple[int, str]:
    output, _ = proc.communicate(timeout=timeout)
    return proc.returncode, output


def _check_records(out: Path, world: int, total: int, epochs: int) -> None:
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    for epoch in range(epochs):
        steps = {rec["epochs"][epoch]["steps"] for rec in records}
        assert len(steps) == 1, f"ranks took different numbers of steps: {steps}"
        assert steps == {records[0]["len"]}
        per_rank = [set(rec["epochs"][epoch]["ids"]) for rec in records]
        everything = [i for rec in records for i in rec["epochs"][epoch]["ids"]]
        assert sorted(everything) == list(range(total)), "not exactly once"
        for a in range(world):
            for b in range(a + 1, world):
                assert not per_rank[a] & per_rank[b]


def test_standalone_two_ranks_cover_the_data_once(ddp_data: Path, tmp_path: Path) -> None:
    proc = _launch(
        ["--standalone", "--nproc_per_node=2"],
        ["--data", str(ddp_data), "--out", str(tmp_path), "--batch-size", "4"],
    )
    code, output = _finish(proc)
    assert code == 0, output
    _check_records(tmp_path, world=2, total=50, epochs=2)


def test_two_nodes_on_one_machine(ddp_data: Path, tmp_path: Path) -> None:
    port = _free_port()
    common = [
        "--nnodes=2",
        "--nproc_per_node=1",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{port}",
        f"--rdzv_id=test-{os.getpid()}-{port}",
    ]
    script = ["--data", str(ddp_data), "--out", str(tmp_path), "--batch-size", "4"]
    nodes = [_launch([*common, f"--node_rank={n}"], script) for n in range(2)]
    results = [_finish(node) for node in nodes]
    for code, output in results:
        assert code == 0, output
    _check_records(tmp_path, world=2, total=50, epochs=2)


def test_mismatched_batch_size_fails_on_every_rank(ddp_data: Path, tmp_path: Path) -> None:
    started = time.monotonic()
    proc = _launch(
        ["--standalone", "--nproc_per_node=2"],
        ["--data", str(ddp_data), "--batch-size", "4", "--batch-size-on-rank", "1=8"],
    )
    code, output = _finish(proc)
    elapsed = time.monotonic() - started
    assert code != 0
    # both ranks raise the same error naming rank 1 and the field
    assert output.count("rank 1 disagrees with rank 0") >= 2, output
    assert "batch_size: rank 1 has 8, rank 0 has 4" in output
    assert elapsed < 120
