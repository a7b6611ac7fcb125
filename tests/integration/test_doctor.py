"""``python -m loader doctor`` and the diagnosis line of the main job's summary."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.integration.test_cli import run_cli

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
    spans = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert {e["name"] for e in spans} >= {"next", "train", "dali", "publish"}


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
