"""A trainer whose sources and steps name DALI only through ``from loader import ndd`` never
imports DALI (epochs, ``output="torch"``, stats, a diagnosis, a save and a resume, the doctor),
and its workers capture and deliver the same bytes as with the direct import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration._jobs import job_env

ROOT = Path(__file__).resolve().parents[2]
LAZY_IMPORT = "from loader import Shard, ndd, sharded_files\n"
DIRECT_IMPORT = (
    "import nvidia.dali.experimental.dynamic as ndd\n\nfrom loader import Shard, sharded_files\n"
)

pytestmark = pytest.mark.timeout(400)


def _trainer(image_root: Path, folder: Path, *module: str) -> dict[str, Any]:
    env = job_env(folder)
    env["PYTHONPATH"] = f"{ROOT}:{folder}"
    done = subprocess.run(
        [sys.executable, "-m", "tests.integration.lazy_trainer", str(image_root), *module],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_a_lazy_job_never_imports_dali_in_the_trainer(image_root: Path, tmp_path: Path) -> None:
    text = (ROOT / "tests" / "lazy_pipelines.py").read_text()
    assert text.count(LAZY_IMPORT) == 1
    (tmp_path / "direct_twin.py").write_text(text.replace(LAZY_IMPORT, DIRECT_IMPORT))

    lazy = _trainer(image_root, tmp_path)
    direct = _trainer(image_root, tmp_path, "direct_twin")

    assert lazy["dali_modules"] == []
    assert "nvidia.dali.experimental.dynamic" in direct["dali_modules"]
    files = lazy["files"]
    assert [sorted(epoch) for epoch in lazy["epochs"]] == [list(range(files))] * 4
    # the saved epoch's second half came from the resumed loader: nothing lost or repeated
    assert len(lazy["epochs"][2]) == files
    # captured: one trace per worker and loader, every later epoch replayed, no fallback
    assert lazy["traces"] == [1, 1, 1, 1] and lazy["warnings"] == []
    # the twin captured and drew the same: same order, same bytes
    assert (direct["epochs"], direct["digest"]) == (lazy["epochs"], lazy["digest"])
    assert direct["traces"] == lazy["traces"]


DOCTOR = """
import runpy
import sys

if __name__ == "__main__":
    try:
        runpy.run_module("loader", run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        assert not stop.code, stop.code
    print("DALI:", sorted(m for m in sys.modules if m.startswith("nvidia.dali")))
"""


def test_the_doctor_over_the_sample_job_imports_no_dali(image_root: Path, tmp_path: Path) -> None:
    script = tmp_path / "doctor.py"
    script.write_text(DOCTOR)
    flags = ["--batch-size", "4", "--seconds", "2", "--train-ms", "5", "--headspace", "4"]
    done = subprocess.run(
        [sys.executable, str(script), "doctor", "--data", str(image_root), *flags],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=job_env(tmp_path),
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "headspace" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "DALI: []"
