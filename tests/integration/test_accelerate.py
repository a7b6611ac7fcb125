"""Real Hugging Face accelerate runs (CPU, gloo) of examples/accelerate_train.py: two processes
under ``accelerate launch``, gradient accumulation that syncs on every epoch's last batch, and a
job SIGKILLed after ``accelerator.save_state`` that resumes with ``load_state`` on two processes
and on one, with every sample of every epoch exactly once.

``accelerate launch --cpu --num_processes 2`` starts a single process in accelerate 1.15 (more CPU
processes need mpirun), so two processes are launched with ``--multi_gpu``; the script's
``Accelerator(cpu=True)`` keeps them on the CPU. One process is the script run by itself.

Each run is made once per test session (under pytest-xdist too: the first test to need a run makes
it, under a file lock, and the others read its result)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")
pytestmark = pytest.mark.timeout(420)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "accelerate_train.py"

SAMPLES = 90
EPOCHS = 3
ACCUMULATE = 5
STEPS = 12  # 2 processes x 1 worker, batches of 4: 2 shards of 45 -> 12 batches per epoch each
KILL_AT = 10  # a multiple of ACCUMULATE: the accumulated gradients were applied before the save
ONE_STEPS = 23  # 1 process x 1 worker: 90 samples -> 23 batches per epoch

# ------------------------------------------------------------------------------ running jobs

_LAUNCHER_VARIABLES = (
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
    "ACCELERATE_",
)


def _env(folder: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_VARIABLES)}
    env["PYTHONPATH"] = str(ROOT)
    env["OMP_NUM_THREADS"] = "1"
    env["HF_HOME"] = str(folder / "hf")  # no accelerate config file of the machine's
    return env


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _run_job(command: list[str], folder: Path, timeout: float = 180) -> dict[str, Any]:
    """Run ``command`` until it ends by itself, then wait until every process it started (the
    launcher's agent, ranks, loader workers) is gone too; SIGKILL what is left and fail."""
    output = folder / "output.txt"
    with open(output, "wb") as out:
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env=_env(folder),
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


def _shared(
    name: str, factory: pytest.TempPathFactory, make: Callable[[Path], dict[str, Any]]
) -> dict[str, Any]:
    """``make(folder)``, once per test session: xdist workers share the result through a file."""
    base = factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the session's folder, above every xdist worker's own
    folder = base / f"accelerate-{name}"
    result = folder / "result.json"
    with open(base / f"accelerate-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not result.exists():
            folder.mkdir(parents=True, exist_ok=True)
            try:
                made = make(folder)
            except BaseException as error:
                made = {"error": f"{type(error).__name__}: {error}"}
            result.write_text(json.dumps(made))
    made = json.loads(result.read_text())
    if "error" in made:
        pytest.fail(f"run {name!r} failed: {made['error']}")
    return made


def _train(folder: Path, processes: int, *args: str) -> dict[str, Any]:
    script = [str(SCRIPT), "--log", str(folder / "log.jsonl"), "--samples", str(SAMPLES)]
    script += ["--epochs", str(EPOCHS), "--accumulate", str(ACCUMULATE), "--workers", "1", *args]
    if processes == 1:
        return _run_job([sys.executable, *script], folder)
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu"]
    launch += ["--num_processes", str(processes), "--num_machines", "1"]
    launch += ["--mixed_precision", "no", "--dynamo_backend", "no"]
    launch += ["--main_process_port", str(_free_port())]
    return _run_job([*launch, *script], folder)


# ------------------------------------------------------------------------------ reading runs


def _records(run: dict[str, Any], event: str, rank: int | None = None) -> list[dict[str, Any]]:
    path = Path(run["folder"]) / "log.jsonl"
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line]
    return [r for r in lines if r["event"] == event and (rank is None or r["rank"] == rank)]


def _steps(run: dict[str, Any], rank: int | None = None, before: int | None = None) -> list[Any]:
    """The run's batches (of ``rank``; below global step ``before``), in step order."""
    steps = [r for r in _records(run, "step", rank) if before is None or r["global_step"] < before]
    return sorted(steps, key=lambda r: (r["global_step"], r["rank"]))


def _ids(steps: list[dict[str, Any]], epoch: int) -> list[int]:
    return [i for step in steps if step["epoch"] == epoch for i in step["ids"]]


def _end(run: dict[str, Any], rank: int = 0) -> dict[str, Any]:
    ends = _records(run, "end", rank)
    assert ends, f"rank {rank} did not finish:\n{_why(run)}"
    return ends[0]


def _why(run: dict[str, Any]) -> str:
    """The errors a failed run printed (each once), then the end of its output."""
    lines = run["output"].splitlines()
    errors = [line for line in lines if "Error: " in line or "Error(" in line]
    return "\n".join([*dict.fromkeys(errors), "--- output:", *lines[-60:]])


def _assert_finished(run: dict[str, Any]) -> None:
    assert run["returncode"] == 0, _why(run)


def _exactly_once(ids: list[int], total: int, what: str) -> None:
    missing = sorted(set(range(total)) - set(ids))
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    assert sorted(ids) == list(range(total)), (
        f"{what}: {len(ids)} samples for {total}, {len(set(ids))} distinct; "
        f"missing {missing}, repeated {repeated}"
    )


def _sync_pattern(steps: int) -> list[tuple[bool, bool]]:
    """(sync_gradients, end_of_dataloader) per batch of an epoch of ``steps`` batches, counted
    from the epoch's start: a sync every ACCUMULATE batches and on the epoch's last batch."""
    return [((s + 1) % ACCUMULATE == 0 or s == steps - 1, s == steps - 1) for s in range(steps)]


def _flags(steps: list[dict[str, Any]]) -> list[tuple[bool, bool]]:
    return [(s["sync_gradients"], s["end_of_dataloader"]) for s in steps]


# ------------------------------------------------------------------------------ the runs


@pytest.fixture
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """2 processes x 1 worker, 3 epochs, accumulation over 5 batches, uninterrupted."""
    run = _shared("reference", tmp_path_factory, lambda d: _train(d, 2))
    _assert_finished(run)
    return run


@pytest.fixture
def killed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same job, save_state every 5 batches, every process SIGKILLed after step 10's: 10 of
    12 batches of epoch 0 taken on each process."""

    def make(folder: Path) -> dict[str, Any]:
        saving = ["--save-every", str(ACCUMULATE), "--ckpt-dir", str(folder / "checkpoints")]
        return _train(folder, 2, *saving, "--kill-at-step", str(KILL_AT))

    run = _shared("killed", tmp_path_factory, make)
    killed = _records(run, "killed")
    assert sorted(r["rank"] for r in killed) == [0, 1], _why(run)
    assert {r["global_step"] for r in killed} == {KILL_AT}
    assert run["returncode"] != 0
    return run


def _resumed(factory: pytest.TempPathFactory, killed: dict[str, Any], processes: int) -> Any:
    state = Path(killed["folder"]) / "checkpoints" / f"step-{KILL_AT:03d}"
    run = _shared(
        f"resumed-on-{processes}",
        factory,
        lambda d: _train(d, processes, "--resume", str(state)),
    )
    _assert_finished(run)
    return run


# ------------------------------------------------------------------------------ the tests


def test_two_processes_cover_each_epoch_once_and_sync_on_its_last_batch(
    reference: dict[str, Any],
) -> None:
    """12 batches per epoch and process, accumulation over 5: the optimizer steps after batches
    5, 10 and 12, and accumulate() sees end_of_dataloader on batch 12 only, every epoch."""
    for rank in (0, 1):
        steps = _steps(reference, rank)
        assert len(steps) == EPOCHS * STEPS
        for epoch in range(EPOCHS):
            in_epoch = [s for s in steps if s["epoch"] == epoch]
            assert _flags(in_epoch) == _sync_pattern(STEPS), f"rank {rank}, epoch {epoch}"
            assert all(s["info"]["epoch"] == epoch for s in in_epoch)
        starts = _records(reference, "epoch_start", rank)
        assert [(r["epoch"], r["len"], r["remaining"]) for r in starts] == [
            (e, STEPS, STEPS) for e in range(EPOCHS)
        ]
        end = _end(reference, rank)
        assert end["global_step"] == EPOCHS * STEPS
        assert [(w["traces"], w["rebuilds"]) for w in end["workers"]] == [(1, 0)]
    for epoch in range(EPOCHS):
        _exactly_once(_ids(_steps(reference), epoch), SAMPLES, f"epoch {epoch}")
    assert _end(reference, 0)["weights"] == _end(reference, 1)["weights"]


def test_killed_job_resumes_on_one_process_exactly_once(
    tmp_path_factory: pytest.TempPathFactory, killed: dict[str, Any]
) -> None:
    """90 - 2 x 10 x 4 = 10 samples left of epoch 0: 3 batches on one process (the last one with
    2 padded rows), synced on the last; then epochs of 23 batches."""
    resumed = _resumed(tmp_path_factory, killed, processes=1)
    before, after = _steps(killed, before=KILL_AT), _steps(resumed)
    rest = [s for s in after if s["epoch"] == 0]
    assert len(rest) == 3
    assert _flags(rest) == [(False, False), (False, False), (True, True)]
    _exactly_once(_ids(before, 0) + _ids(rest, 0), SAMPLES, "the interrupted epoch 0")
    starts = _records(resumed, "epoch_start")
    assert [(r["epoch"], r["remaining"]) for r in starts] == [
        (0, 3),
        (1, ONE_STEPS),
        (2, ONE_STEPS),
    ]
    for epoch in range(1, EPOCHS):
        in_epoch = [s for s in after if s["epoch"] == epoch]
        assert _flags(in_epoch) == _sync_pattern(ONE_STEPS), f"epoch {epoch}"
        _exactly_once(_ids(in_epoch, epoch), SAMPLES, f"epoch {epoch} after the resume")
    assert _end(resumed)["global_step"] == KILL_AT + 3 + 2 * ONE_STEPS


def test_killed_job_resumes_on_two_processes_with_the_uninterrupted_stream(
    tmp_path_factory: pytest.TempPathFactory,
    reference: dict[str, Any],
    killed: dict[str, Any],
) -> None:
    resumed = _resumed(tmp_path_factory, killed, processes=2)
    for rank in (0, 1):
        before, after = _steps(killed, rank, before=KILL_AT), _steps(resumed, rank)
        uninterrupted = _steps(reference, rank)
        assert [s["global_step"] for s in after] == list(range(KILL_AT, EPOCHS * STEPS))
        assert [s["ids"] for s in before + after] == [s["ids"] for s in uninterrupted], (
            f"rank {rank}: the resumed stream is not the uninterrupted one"
        )
        assert _flags(before + after) == _flags(uninterrupted), f"rank {rank}: other syncs"
        first = _records(resumed, "epoch_start", rank)[0]
        assert (first["epoch"], first["len"], first["remaining"]) == (0, STEPS, STEPS - KILL_AT)
        assert _end(resumed, rank)["weights"] == _end(reference, rank)["weights"]
    everything = _steps(killed, before=KILL_AT) + _steps(resumed)
    for epoch in range(EPOCHS):
        _exactly_once(_ids(everything, epoch), SAMPLES, f"epoch {epoch} over both runs")
    # register_for_checkpointing(loader, ...): the loader's state is the first custom object
    saved = Path(killed["folder"]) / "checkpoints" / f"step-{KILL_AT:03d}"
    state = torch.load(saved / "custom_checkpoint_0.pkl", weights_only=False)
    assert (state["epoch"], state["layout"]["world_size"], state["received"]) == (0, 2, [10, 10])
