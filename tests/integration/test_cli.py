"""The main job, ``python -m loader``, as a user runs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-m", "loader", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )


@pytest.mark.parametrize("capture", ["--capture", "--no-capture"])
def test_main_job_prints_a_summary(image_root: Path, capture: str) -> None:
    result = run_cli(
        "--data", str(image_root), "--epochs", "2", "--workers", "2", "--batch-size", "10", capture
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "summary" in out and "samples/s" in out and "MB/s moved" in out
    # 48 images, 2 epochs, exactly once each: 24 per shard in batches of 10, the 6 padded rows of
    # each shard's last batch are flagged and not counted
    assert "samples            96" in out
    assert "epoch 1" in out  # the progress bar of the second epoch
    figures = dict(
        re.findall(r"(?m)^\s*(startup|iteration|first batch|trainer waited)\s+([\d.]+) s", out)
    )
    assert len(figures) == 4, out
    # startup apart from iteration; what happens during iteration is inside it
    iteration = float(figures["iteration"])
    assert float(figures["first batch"]) <= iteration
    assert float(figures["trainer waited"]) <= iteration
    rows = [line.split() for line in out.splitlines()]
    traces = [
        int(r[3]) for r in rows if len(r) == 7 and all(f.replace(".", "").isdigit() for f in r)
    ]
    assert traces == ([1, 1] if capture == "--capture" else [0, 0])


def test_main_job_tunes_its_workers_with_workers_auto(image_root: Path) -> None:
    result = run_cli(
        "--data", str(image_root), "--epochs", "2", "--workers", "auto", "--no-progress"
    )
    assert result.returncode == 0, result.stderr
    assert "auto workers" in result.stdout and "samples            96" in result.stdout
    assert re.search(r"(?m)^  autotune +\d+ workers x \d+ threads", result.stdout), result.stdout
    bad = run_cli("--workers", "some")
    assert bad.returncode == 2 and "expected a number or auto" in bad.stderr


def test_main_job_says_a_file_is_not_a_dataset(tmp_path: Path) -> None:
    path = tmp_path / "train.txt"
    path.write_text("not images")
    result = run_cli("--data", str(path), "--epochs", "1")
    assert result.returncode == 2
    assert "is a file" in result.stderr and "does not exist" not in result.stderr


@pytest.mark.parametrize("name", ["missing", "missing.parquet", "missing.tar"])
def test_main_job_rejects_a_missing_directory_or_file(tmp_path: Path, name: str) -> None:
    result = run_cli("--data", str(tmp_path / name), "--epochs", "1")
    assert result.returncode == 2
    assert "does not exist" in result.stderr
    assert "worker" not in result.stderr  # (before any worker starts)


def test_main_job_reads_parquet_as_it_reads_an_image_folder(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    pytest.importorskip("datasets")
    from tests import parquet_pipelines as P

    P.write_parquet(tmp_path / "pq", (30, 18), 10)
    result = run_cli("--data", str(tmp_path / "pq"), "--epochs", "1", "--batch-size", "8")
    assert result.returncode == 0, result.stderr
    assert f"parquet data at {tmp_path / 'pq'}" in result.stdout
    assert "samples            48" in result.stdout  # (every row once, padding not counted)


def test_main_job_reads_parquet_by_a_glob_and_named_columns_and_points_to_nested_files(
    tmp_path: Path,
) -> None:
    """A glob without ``.parquet`` in it is read as Parquet (it was taken for an ImageFolder),
    ``--columns`` names other columns than image and label (there was no way to), and a
    directory whose Parquet files lie one level down (``load_dataset``'s layout) is pointed to
    them in the error."""
    pytest.importorskip("pyarrow")
    pytest.importorskip("datasets")
    import pyarrow.parquet as pq

    from tests import parquet_pipelines as P

    paths = P.write_parquet(tmp_path / "hub" / "data", (30, 18), 10)
    result = run_cli("--data", str(tmp_path / "hub" / "data" / "train-*"), "--epochs", "1")
    assert result.returncode == 0, result.stderr
    assert "samples            48" in result.stdout
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    for path in paths:
        table = pq.read_table(path)
        pq.write_table(table.rename_columns(["img", "cls", "id"]), renamed / path.name)
    result = run_cli("--data", str(renamed), "--columns", "img,cls", "--epochs", "1")
    assert result.returncode == 0, result.stderr
    assert "samples            48" in result.stdout
    result = run_cli("--data", str(renamed), "--epochs", "1")  # (without --columns)
    assert result.returncode == 1
    assert "its columns: img, cls, id. Pass --columns IMAGE,LABEL naming" in result.stderr
    result = run_cli("--data", str(tmp_path / "hub"), "--epochs", "1")
    assert result.returncode == 2
    assert f"it holds Parquet files under {tmp_path / 'hub' / 'data'}: pass --data" in (
        result.stderr
    )


def test_the_progress_bar_ends_on_the_rows_delivered_when_the_last_batch_is_padded(
    tmp_path: Path,
) -> None:
    pytest.importorskip("pyarrow")
    pytest.importorskip("datasets")
    from tests import parquet_pipelines as P

    P.write_parquet(tmp_path / "pq", (30, 13), 10)  # 43 rows: the last batches padded
    result = run_cli("--data", str(tmp_path / "pq"), "--epochs", "1", "--batch-size", "8")
    assert result.returncode == 0, result.stderr
    last = [line for line in result.stdout.replace("\r", "\n").splitlines() if "epoch 0" in line]
    assert last and "100%" in last[-1] and "43/43" in last[-1], last[-3:]


def test_main_job_says_where_the_sample_dataset_cannot_be_written(tmp_path: Path) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")  # (a cache directory under a file: unwritable, root or not)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env.update(PYTHONPATH=str(ROOT), XDG_CACHE_HOME=str(blocked / "cache"))
    result = subprocess.run(
        [sys.executable, "-m", "loader", "--epochs", "1", "--no-progress"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert f"cannot be written to {blocked}" in result.stderr
    assert "set XDG_CACHE_HOME to a writable directory, or pass --data" in result.stderr


def test_main_job_stopped_by_a_sigterm_closes_its_loader_and_says_so(image_root: Path) -> None:
    """A cluster stops a job with SIGTERM to its process group: the main job says so and
    exits 143 (it exited at once, silently), its workers gone."""
    import signal
    import time

    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env["PYTHONPATH"] = str(ROOT)
    command = [sys.executable, "-m", "loader", "--data", str(image_root), "--epochs", "500"]
    job = subprocess.Popen(
        [*command, "--batch-size", "8"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert job.stdout is not None
        for line in job.stdout:  # (the job's start: its first line)
            if "workers" in line:
                break
        time.sleep(3)
        os.killpg(job.pid, signal.SIGTERM)
        _, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert job.returncode == 143, err
    assert "terminated (SIGTERM)" in err and "Traceback" not in err
    deadline = time.monotonic() + 30  # (the worker server ends once it sees the job gone)
    while (left := in_group(job.pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == []


def in_group(group: int) -> list[int]:
    """The live processes (zombies left out) of process group ``group``, from ``/proc``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == group:  # (state, ppid, pgrp)
            found.append(int(entry))
    return found
