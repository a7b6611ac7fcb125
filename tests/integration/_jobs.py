"""Running a training script as a real job (a launcher, its ranks, their loader workers) and
reading the JSON-lines log it writes: shared by the Lightning and accelerate tests.

A run is made once per test session, under pytest-xdist too: the first test that needs it makes
it under a file lock, and the others read its result."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]

#: What a launcher or pytest-xdist set in this process, which a job must not inherit.
LAUNCHER_VARIABLES = (
    "PYTEST_XDIST",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC",
    "PL_",
    "ACCELERATE_",
)


def job_env(folder: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARIABLES)}
    env["PYTHONPATH"] = str(ROOT)
    env["OMP_NUM_THREADS"] = "1"
    env["HF_HOME"] = str(folder / "hf")  # no accelerate config file of the machine's
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def run_job(command: list[str], folder: Path, timeout: float = 180) -> dict[str, Any]:
    """Run ``command`` until it ends by itself, then wait until every process it started (the
    launcher's agent, ranks, loader workers) is gone too; SIGKILL what is left and fail."""
    output = folder / "output.txt"
    with open(output, "wb") as out:
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env=job_env(folder),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    seen: dict[int, psutil.Process] = {}
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(proc.pid).children(recursive=True):
                    seen.setdefault(child.pid, child)
            time.sleep(0.1)
    finally:
        timed_out = proc.poll() is None
        if timed_out:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            for process in seen.values():  # torch.distributed.run gives each rank a session
                with contextlib.suppress(psutil.Error):
                    process.kill()
        proc.wait(timeout=30)
        left = list(seen.values())
        grace = time.monotonic() + 30
        while left and time.monotonic() < grace:
            time.sleep(0.1)
            left = [p for p in left if _running(p)]
        for process in left:
            with contextlib.suppress(psutil.Error):
                process.kill()
    text = output.read_text(errors="replace")
    assert not timed_out, f"the job ran past {timeout} s:\n{text[-6000:]}"
    assert not left, f"processes of the job outlived it: {[p.pid for p in left]}\n{text[-6000:]}"
    return {"returncode": proc.returncode, "output": text[-12000:], "folder": str(folder)}


#: How making a run fails, which :func:`shared` keeps as the run's result: :func:`run_job`'s
#: asserts (the job ran past its timeout, or its processes outlived it), the job that cannot start
#: or whose files cannot be written (OSError), a launcher that does not end once killed
#: (subprocess.TimeoutExpired), and pytest.fail -- pytest-timeout's, when a test's time runs out
#: while it makes the run.
JOB_FAILURES: tuple[type[BaseException], ...] = (
    AssertionError,
    OSError,
    subprocess.SubprocessError,
    pytest.fail.Exception,
)


def shared(
    name: str, factory: pytest.TempPathFactory, make: Callable[[Path], dict[str, Any]]
) -> dict[str, Any]:
    """``make(folder)``, once per test session: xdist workers share the result through a file."""
    base = factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the session's folder, above every xdist worker's own
    folder = base / name
    result = folder / "result.json"
    with open(base / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not result.exists():
            folder.mkdir(parents=True, exist_ok=True)
            try:
                made = make(folder)
            except JOB_FAILURES as error:
                # the run failed: kept, so that the other tests that need it (in this process or
                # another xdist worker, waiting on the lock) fail with it instead of running it
                # again. Anything else -- Ctrl-C (KeyboardInterrupt), SystemExit, a skip, a bug in
                # ``make`` (TypeError, KeyError...) -- propagates as it is, and nothing is kept.
                made = {"error": f"{type(error).__name__}: {error}"}
            result.write_text(json.dumps(made))
    made = json.loads(result.read_text())
    if "error" in made:
        pytest.fail(f"run {name!r} failed: {made['error']}")
    return made


# ------------------------------------------------------------------------------ reading runs


def records(run: dict[str, Any], event: str, rank: int | None = None) -> list[dict[str, Any]]:
    path = Path(run["folder"]) / "log.jsonl"
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line]
    return [r for r in lines if r["event"] == event and (rank is None or r["rank"] == rank)]


def steps(run: dict[str, Any], rank: int | None = None, before: int | None = None) -> list[Any]:
    """The run's batches (of ``rank``; below global step ``before``), in step order."""
    taken = [r for r in records(run, "step", rank) if before is None or r["global_step"] < before]
    return sorted(taken, key=lambda r: (r["global_step"], r["rank"]))


def ids(taken: list[dict[str, Any]], epoch: int) -> list[int]:
    return [i for step in taken if step["epoch"] == epoch for i in step["ids"]]


def end(run: dict[str, Any], rank: int = 0) -> dict[str, Any]:
    ends = records(run, "end", rank)
    assert ends, f"rank {rank} did not finish:\n{why(run)}"
    return ends[0]


def why(run: dict[str, Any]) -> str:
    """The errors a failed run printed (each once), then the end of its output."""
    lines = run["output"].splitlines()
    errors = [line for line in lines if "Error: " in line or "Error(" in line]
    return "\n".join([*dict.fromkeys(errors), "--- output:", *lines[-60:]])


def assert_finished(run: dict[str, Any]) -> None:
    assert run["returncode"] == 0, why(run)


def exactly_once(taken: list[int], total: int, what: str) -> None:
    missing = sorted(set(range(total)) - set(taken))
    repeated = sorted({i for i in taken if taken.count(i) > 1})
    assert sorted(taken) == list(range(total)), (
        f"{what}: {len(taken)} samples for {total}, {len(set(taken))} distinct; "
        f"missing {missing}, repeated {repeated}"
    )


def alive(pids: list[int]) -> list[int]:
    """Those of ``pids`` that are still running (not gone, not zombies)."""
    import psutil

    found = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                found.append(pid)
        except psutil.NoSuchProcess:
            continue
    return found
