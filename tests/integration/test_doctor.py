"""``python -m loader doctor`` and the diagnosis line of the main job's summary."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_cli import ROOT, run_cli

pytestmark = pytest.mark.timeout(180)


def test_doctor_measures_and_prints_a_verdict_the_headspace_and_a_trace(
    image_root: Path, tmp_path: Path
) -> None:
    trace = tmp_path / "doctor-trace.json"
    result = run_cli(
        "doctor",
        *("--data", str(image_root), "--batch-size", "4", "--workers", "2"),
        *("--seconds", "1.5", "--headspace", "3", "--train-ms", "2", "--trace", str(trace)),
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert re.search(r"(?m)^(input-bound|not input-bound): the trainer waited [\d.]+%", out), out
    assert re.search(r"(?m)^  suggestion: \S", out), out
    assert re.search(r"(?m)^  with the loader: [\d.]+ batches/s", out), out
    alone = re.search(r"headspace: the loop alone, over 3 batches .*: ([\d.]+) batches/s", out)
    assert alone is not None, out
    assert float(alone.group(1)) < 1000 / 2  # the 2 ms stand-in step bounds the loop alone
    assert "headspace: not computed" not in out, out
    spans = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert {e["name"] for e in spans} >= {"next", "train", "dali", "publish"}


HEADSPACE = re.compile(
    r"(?m)^  headspace: the loop alone, over 2 batches replayed from memory: [\d.]+ batches/s"
)
NO_STEP = re.compile(r"(?m)^  headspace: not computed, .*training step.*--train-ms MS \(.*\)$")


@pytest.mark.parametrize("train_ms", [None, "1"], ids=["no-train-ms", "train-ms"])
def test_doctor_prints_the_headspace_only_with_a_training_step(train_ms: str | None) -> None:
    """Without --train-ms the loop body does nothing, and the loop alone runs at a rate that
    compares with nothing: no headspace then, but a line naming the flag that gives one."""
    step = () if train_ms is None else ("--train-ms", train_ms)
    result = run_cli(
        "doctor",
        *("--source", "tests.pipelines:sample_source", "--step", "tests.pipelines:cast_step"),
        *("--batch-size", "4", "--seconds", "0.5", "--headspace", "2", *step),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert re.search(r"(?m)^  with the loader: [\d.]+ batches/s", out), out
    if train_ms is None:
        assert "headspace: the loop alone" not in out, out
        assert "with the loader it runs at" not in out, out
        assert len(NO_STEP.findall(out)) == 1, out
    else:
        assert HEADSPACE.search(out), out
        assert "headspace: not computed" not in out, out


def test_doctor_refuses_a_negative_headspace(image_root: Path) -> None:
    result = run_cli("doctor", "--data", str(image_root), "--headspace", "-1")
    assert result.returncode == 2
    assert "--headspace" in result.stderr


def test_the_main_job_summary_has_a_diagnosis_line(image_root: Path) -> None:
    result = run_cli("--data", str(image_root), "--epochs", "2", "--batch-size", "4")
    assert result.returncode == 0, result.stderr
    line = re.search(r"(?m)^  diagnosis +(.*)$", result.stdout)
    assert line is not None, result.stdout
    assert line.group(1).startswith(("input-bound", "not input-bound", "too little to judge"))


def test_doctor_runs_your_own_source_and_step(tmp_path: Path) -> None:
    """--source/--step name module-level functions as workers import them; a source with a
    batch_size parameter gets --batch-size (sample_source's default is 4, here 6)."""
    trace = tmp_path / "own.json"
    result = run_cli(
        "doctor",
        *("--source", "tests.pipelines:sample_source", "--step", "tests.pipelines:cast_step"),
        *("--batch-size", "6", "--seconds", "1", "--headspace", "2", "--trace", str(trace)),
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("source tests.pipelines:sample_source, step tests.pipelines:cast_step")
    assert re.search(r"(?m)^(input-bound|not input-bound): the trainer waited [\d.]+%", out), out
    assert re.search(r"(?m)^  suggestion: \S", out), out
    assert re.search(r"(?m)^  with the loader: [\d.]+ batches/s", out), out
    assert "  every rank:" not in out  # one rank: no shared line
    assert f"trace: {trace} " in out
    spans = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert {e["name"] for e in spans} >= {"next", "train", "load", "dali", "publish"}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ("--source", "tests.pipelines", "--step", "tests.pipelines:cast_step"),
            "--source takes MODULE:FUNCTION",
        ),
        (
            ("--source", "tests.no_such_module:x", "--step", "tests.pipelines:cast_step"),
            "there is no module 'tests.no_such_module' to import",
        ),
        (
            ("--source", "tests.pipelines:sample_source", "--step", "tests.pipelines:no_step"),
            "module tests.pipelines has no 'no_step'; its functions: ",
        ),
        (
            ("--source", "tests.pipelines:np", "--step", "tests.pipelines:cast_step"),
            "np is a module, not a function",
        ),
        (("--step", "tests.pipelines:cast_step"), "--source and --step go together"),
        (
            ("--data", "x", "--source", "a:b", "--step", "a:c"),
            "either --data (the built-in pipeline) or --source/--step",
        ),
    ],
)
def test_doctor_says_what_is_wrong_with_a_function_name(
    flags: tuple[str, ...], message: str
) -> None:
    result = run_cli("doctor", *flags, "--seconds", "1")
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_doctor_under_torchrun_runs_every_rank_and_rank_0_prints(tmp_path: Path) -> None:
    """2 local ranks: both run the job and the doctor's diagnose(); rank 0 alone prints the
    verdict, with each rank's verdict line, each rank's rate, the settings every rank shares,
    and both ranks' trace files."""
    pytest.importorskip("torch")
    trace = tmp_path / "doctor-{rank}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env["PYTHONPATH"] = str(ROOT)
    env["OMP_NUM_THREADS"] = "1"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    doctor = ["-m", "loader", "doctor", "--source", "tests.timing_pipelines:sleeping_source"]
    doctor += ["--step", "tests.timing_pipelines:id_step", "--batch-size", "8"]
    doctor += ["--seconds", "1.5", "--trace", str(trace)]
    result = subprocess.run(
        [*launcher, *doctor],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
    )
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    verdicts = re.findall(r"(?m)^(input-bound|not input-bound|too little to judge)", out)
    assert len(verdicts) == 1, out  # rank 0's report, once
    assert out.count("source tests.timing_pipelines:sleeping_source") == 1
    assert re.search(r"(?m)^  rank 0 \(this rank\): ", out), out
    assert re.search(r"(?m)^  rank 1: ", out), out
    assert len(re.findall(r"(?m)^  every rank: ", out)) == 1, out
    assert re.search(r"(?m)^  rank 1: with the loader: [\d.]+ batches/s", out), out
    assert "(this rank's share of" in out  # the CPUs split between the 2 local ranks
    assert "headspace: the loop alone" not in out, out  # no --train-ms: no headspace
    assert len(NO_STEP.findall(out)) == 1, out  # but the line saying so, once
    for rank in (0, 1):
        path = tmp_path / f"doctor-{rank}.json"
        assert str(path) in out
        events = json.loads(path.read_text())["traceEvents"]
        [process] = [e["args"]["name"] for e in events if e["name"] == "process_name"]
        assert process == f"dali-capture-loader, rank {rank} of 2"
