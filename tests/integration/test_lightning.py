"""Real PyTorch Lightning runs (CPU; DDP over gloo) of examples/lightning_train.py: batch.info in
training_step, one trace per worker over three epochs, and jobs SIGKILLed after one of Lightning's
own checkpoints that resume from it, mid-epoch or at an epoch's end, on the same or another
number of devices, with every sample of every epoch exactly once.

Each run is made once per test session (under pytest-xdist too: the first test to need a run makes
it, under a file lock, and the others read its result)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("pytorch_lightning")
pytestmark = pytest.mark.timeout(420)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "lightning_train.py"

SAMPLES = 90  # 1 device x 2 workers, batches of 4: 2 shards of 45 -> 12 + 12 = 24 steps/epoch
STEPS = 24
EPOCHS = 3
IMAGES = 48  # conftest's image_root; 2 ranks x 1 worker: 2 shards of 24 -> 6 steps/epoch/rank
DDP_STEPS = 6

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
    "PL_",
)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_VARIABLES)}
    env["PYTHONPATH"] = str(ROOT)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _run_job(command: list[str], folder: Path, timeout: float = 180) -> dict[str, Any]:
    """Run ``command`` until it ends by itself, then wait until every process it started (ranks,
    loader workers) is gone too; SIGKILL what is left and fail."""
    output = folder / "output.txt"
    with open(output, "wb") as out:
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env=_env(),
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
            for process in seen.values():
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
    folder = base / f"lightning-{name}"
    result = folder / "result.json"
    with open(base / f"lightning-{name}.lock", "w") as lock:
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


def _train(folder: Path, *args: str) -> dict[str, Any]:
    command = [sys.executable, str(SCRIPT), "--log", str(folder / "log.jsonl"), *args]
    return _run_job(command, folder)


def _synthetic(*args: str) -> list[str]:
    return ["--samples", str(SAMPLES), "--batch-size", "4", "--epochs", str(EPOCHS), *args]


def _images(root: Path, *args: str) -> list[str]:
    return ["--data", str(root), "--batch-size", "4", "--epochs", str(EPOCHS), *args]


# ------------------------------------------------------------------------------ reading runs


def _records(run: dict[str, Any], event: str) -> list[dict[str, Any]]:
    path = Path(run["folder"]) / "log.jsonl"
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line]
    return [r for r in lines if r["event"] == event]


def _steps(run: dict[str, Any], rank: int | None = None, before: int | None = None) -> list[Any]:
    """The run's training steps (of ``rank``; below global step ``before``), in step order."""
    steps = [
        r
        for r in _records(run, "step")
        if (rank is None or r["rank"] == rank) and (before is None or r["global_step"] < before)
    ]
    return sorted(steps, key=lambda r: (r["global_step"], r["rank"]))


def _ids(steps: list[dict[str, Any]], epoch: int) -> list[int]:
    return [i for step in steps if step["epoch"] == epoch for i in step["ids"]]


def _end(run: dict[str, Any], rank: int = 0) -> dict[str, Any]:
    ends = [r for r in _records(run, "end") if r["rank"] == rank]
    assert ends, f"rank {rank} did not finish fit:\n{_why(run)}"
    return ends[0]


def _why(run: dict[str, Any]) -> str:
    """The errors a failed run printed (each once), then the end of its output."""
    lines = run["output"].splitlines()
    errors = [line for line in lines if "Error: " in line or "Error(" in line]
    return "\n".join([*dict.fromkeys(errors), "--- output:", *lines[-60:]])


def _assert_finished(run: dict[str, Any]) -> None:
    assert run["returncode"] == 0, _why(run)


def _assert_killed(run: dict[str, Any], step: int, ranks: int) -> None:
    killed = _records(run, "killed")
    assert sorted(r["rank"] for r in killed) == list(range(ranks)), _why(run)
    assert {r["global_step"] for r in killed} == {step}
    assert run["returncode"] == -signal.SIGKILL


def _exactly_once(ids: list[int], total: int, what: str) -> None:
    missing = sorted(set(range(total)) - set(ids))
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    assert sorted(ids) == list(range(total)), (
        f"{what}: {len(ids)} samples for {total}, {len(set(ids))} distinct; "
        f"missing {missing}, repeated {repeated}"
    )


def _loader_state(checkpoint: Path) -> dict[str, Any]:
    """The loader's state in one of Lightning's checkpoints."""
    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)
    states = saved["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert len(states) == 1
    return dict(states[0])


# ------------------------------------------------------------------------------ the runs


@pytest.fixture
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """1 device x 2 workers, 3 epochs, uninterrupted."""
    run = _shared("reference", tmp_path_factory, lambda d: _train(d, *_synthetic()))
    _assert_finished(run)
    return run


@pytest.fixture
def killed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same job, checkpointed every 6 steps and SIGKILLed after step 30's checkpoint: 6
    batches into epoch 1, 3 per worker."""

    def make(folder: Path) -> dict[str, Any]:
        ckpt = ["--ckpt-dir", str(folder / "checkpoints"), "--every", "6"]
        return _train(folder, *_synthetic(*ckpt, "--kill-at-step", "30"))

    run = _shared("killed", tmp_path_factory, make)
    _assert_killed(run, 30, ranks=1)
    return run


def _resumed(name: str, factory: pytest.TempPathFactory, killed: dict[str, Any], step: int) -> Any:
    checkpoint = Path(killed["folder"]) / "checkpoints" / f"step-{step:03d}.ckpt"
    run = _shared(name, factory, lambda d: _train(d, *_synthetic("--resume", str(checkpoint))))
    _assert_finished(run)
    return run


@pytest.fixture
def resumed_mid_epoch(
    tmp_path_factory: pytest.TempPathFactory, killed: dict[str, Any]
) -> dict[str, Any]:
    return _resumed("resumed-30", tmp_path_factory, killed, 30)


@pytest.fixture
def resumed_at_epoch_end(
    tmp_path_factory: pytest.TempPathFactory, killed: dict[str, Any]
) -> dict[str, Any]:
    return _resumed("resumed-24", tmp_path_factory, killed, 24)


@pytest.fixture
def ddp_killed(tmp_path_factory: pytest.TempPathFactory, image_root: Path) -> dict[str, Any]:
    """2 ranks (DDP, gloo) x 1 worker over 48 images, a checkpoint every 2 steps, every rank
    SIGKILLed after step 4's: 4 of 6 batches of epoch 0 taken on each rank. The loader is built
    before trainer.fit, before Lightning's launcher has set up the ranks."""

    def make(folder: Path) -> dict[str, Any]:
        ckpt = ["--ckpt-dir", str(folder / "checkpoints"), "--every", "2"]
        ddp = ["--devices", "2", "--strategy", "ddp", "--workers", "1"]
        return _train(folder, *_images(image_root, *ddp, *ckpt, "--kill-at-step", "4"))

    run = _shared("ddp-killed", tmp_path_factory, make)
    _assert_killed(run, 4, ranks=2)
    return run


def _ddp_resumed(
    factory: pytest.TempPathFactory, killed: dict[str, Any], image_root: Path, devices: int
) -> dict[str, Any]:
    checkpoint = Path(killed["folder"]) / "checkpoints" / "step-004.ckpt"
    layout = ["--devices", str(devices), "--workers", "1"]
    if devices > 1:
        layout += ["--strategy", "ddp"]
    args = _images(image_root, *layout, "--resume", str(checkpoint))
    run = _shared(f"ddp-resumed-on-{devices}", factory, lambda d: _train(d, *args))
    _assert_finished(run)
    return run


# ------------------------------------------------------------------------------ the tests
# in this order, pytest-xdist's first chunks (two tests per worker) need different runs


def test_three_epochs_trace_once_and_never_rebuild(reference: dict[str, Any]) -> None:
    """Lightning calls iter(loader) once and throws the iterator away (to check the loader is
    iterable), and never calls next() after an epoch's len(loader)-th batch: neither may abort an
    epoch, so each worker traces once and replays for all three epochs."""
    workers = _end(reference)["workers"]
    assert len(workers) == 2
    assert [(w["traces"], w["rebuilds"]) for w in workers] == [(1, 0), (1, 0)], workers
    assert [w["steps"] for w in workers] == [EPOCHS * STEPS // 2] * 2
    assert _end(reference)["loader_epoch"] == EPOCHS


def test_batch_info_reaches_training_step(reference: dict[str, Any]) -> None:
    """Lightning moves the batch to the device (move_data_to_device) between the loader and
    training_step; batch.info must survive it."""
    steps = _steps(reference)
    lost = [s["global_step"] for s in steps if s["info"] is None]
    assert not lost, f"batch.info missing in training_step at {len(lost)} of {len(steps)} steps"
    for s in steps:
        info = s["info"]
        assert info == s["info_before_transfer"]
        assert info["epoch"] == s["epoch"], "the loader's epoch is not Lightning's"
        assert info["step"] == s["batch_idx"] // 2  # round robin over 2 workers
        assert info["worker"] == s["batch_idx"] % 2
        assert info["shard"] == info["worker"]
    # 45 samples per shard: the last batch of each shard has 3 padded rows
    assert {s["padded"] for s in steps if s["batch_idx"] >= STEPS - 2} == {3}
    assert {s["padded"] for s in steps if s["batch_idx"] < STEPS - 2} == {0}


def test_ddp_killed_job_resumes_on_two_devices(
    tmp_path_factory: pytest.TempPathFactory, ddp_killed: dict[str, Any], image_root: Path
) -> None:
    resumed = _ddp_resumed(tmp_path_factory, ddp_killed, image_root, devices=2)
    before, after = _steps(ddp_killed, before=4), _steps(resumed)
    _exactly_once(_ids(before, 0) + _ids(after, 0), IMAGES, "the interrupted epoch 0")
    for epoch in range(1, EPOCHS):
        _exactly_once(_ids(after, epoch), IMAGES, f"epoch {epoch} after the resume")
    for rank in (0, 1):
        steps = [s["global_step"] for s in after if s["rank"] == rank]
        assert steps == list(range(4, EPOCHS * DDP_STEPS)), f"rank {rank} took steps {steps}"
        assert _end(resumed, rank)["global_step"] == EPOCHS * DDP_STEPS
        assert {s["len"] for s in after if s["rank"] == rank and s["epoch"] == 0} == {DDP_STEPS}
    assert {s["world_size"] for s in after} == {2}
    assert all(s["info"] is not None for s in after)
    state = _loader_state(Path(ddp_killed["folder"]) / "checkpoints" / "step-004.ckpt")
    assert (state["epoch"], state["layout"]["world_size"], state["received"]) == (0, 2, [4, 4])


def test_ddp_killed_job_resumes_on_one_device(
    tmp_path_factory: pytest.TempPathFactory, ddp_killed: dict[str, Any], image_root: Path
) -> None:
    """48 - 2 ranks x 4 batches x 4 = 16 samples left of epoch 0: 4 batches on one device. 4
    received + 4 left is shorter than this layout's epochs of 12 batches, and Lightning keeps
    the length it reads after the resume for every later epoch: len(loader) is 12 throughout,
    and the resumed epoch ends after its 4 batches (Lightning stops cleanly at the iterator's
    end). With len() = 8 epochs 1 and 2 lost 16 of their 48 samples each."""
    resumed = _ddp_resumed(tmp_path_factory, ddp_killed, image_root, devices=1)
    before, after = _steps(ddp_killed, before=4), _steps(resumed)
    _exactly_once(_ids(before, 0) + _ids(after, 0), IMAGES, "the interrupted epoch 0")
    for epoch in range(1, EPOCHS):
        _exactly_once(_ids(after, epoch), IMAGES, f"epoch {epoch} after the resume")
    assert [s["global_step"] for s in after] == list(range(4, 4 + 4 + 2 * 12)), (
        f"the resumed run took steps {[s['global_step'] for s in after]}"
    )
    assert {s["len"] for s in after} == {12}
    assert _end(resumed)["global_step"] == 4 + 4 + 2 * 12


def test_every_epoch_is_the_dataset_once_and_len_is_the_epoch(reference: dict[str, Any]) -> None:
    steps = _steps(reference)
    assert len(steps) == EPOCHS * STEPS
    assert _end(reference)["global_step"] == EPOCHS * STEPS
    for epoch in range(EPOCHS):
        _exactly_once(_ids(steps, epoch), SAMPLES, f"epoch {epoch}")
        assert [s["len"] for s in steps if s["epoch"] == epoch] == [STEPS] * STEPS
    starts = _records(reference, "epoch_start")
    assert [(r["epoch"], r["len"], r["batches"]) for r in starts] == [
        (e, STEPS, STEPS) for e in range(EPOCHS)
    ]


def test_killed_mid_epoch_resumes_from_lightnings_checkpoint_exactly_once(
    reference: dict[str, Any], killed: dict[str, Any], resumed_mid_epoch: dict[str, Any]
) -> None:
    before, after = _steps(killed, before=30), _steps(resumed_mid_epoch)
    assert [s["global_step"] for s in before] == list(range(30))
    _exactly_once(_ids(before, 1) + _ids(after, 1), SAMPLES, "the interrupted epoch 1")
    for epoch in range(2, EPOCHS):
        _exactly_once(_ids(after, epoch), SAMPLES, f"epoch {epoch} after the resume")
    assert [s["global_step"] for s in after] == list(range(30, EPOCHS * STEPS)), (
        f"the resumed run took {len(after)} steps, the uninterrupted one "
        f"{EPOCHS * STEPS - 30} after step 30"
    )
    assert _end(resumed_mid_epoch)["global_step"] == _end(reference)["global_step"]
    # len(loader) in the resumed epoch: the epoch's full length (received before + left)
    assert {s["len"] for s in after if s["epoch"] == 1} == {STEPS}
    # Lightning stored the loader's state in its checkpoint: 3 batches of each worker received
    state = _loader_state(Path(killed["folder"]) / "checkpoints" / "step-030.ckpt")
    assert (state["epoch"], state["received"]) == (1, [3, 3])
    # same layout: the uninterrupted stream, batch for batch, and so the same weights
    assert [s["ids"] for s in before + after] == [s["ids"] for s in _steps(reference)]
    assert [s["info"] for s in after] == [s["info"] for s in _steps(reference)[30:]]
    assert _end(resumed_mid_epoch)["weights"] == _end(reference)["weights"]


def test_checkpoint_at_an_epochs_last_batch_resumes_with_the_next_epoch(
    reference: dict[str, Any], killed: dict[str, Any], resumed_at_epoch_end: dict[str, Any]
) -> None:
    """Step 24 is epoch 0's last batch; Lightning saved it in on_train_batch_end, without another
    next(): the state is epoch 1 with nothing received, and the resume runs epochs 1 and 2."""
    after = _steps(resumed_at_epoch_end)
    assert "No training batches" not in resumed_at_epoch_end["output"]
    assert [s["global_step"] for s in after] == list(range(STEPS, EPOCHS * STEPS)), (
        f"the run resumed at epoch 0's end took {len(after)} steps, not {2 * STEPS}"
    )
    for epoch in range(1, EPOCHS):
        _exactly_once(_ids(after, epoch), SAMPLES, f"epoch {epoch} after the resume")
    assert _end(resumed_at_epoch_end)["global_step"] == EPOCHS * STEPS
    state = _loader_state(Path(killed["folder"]) / "checkpoints" / "step-024.ckpt")
    assert (state["epoch"], state["received"]) == (1, [0, 0])
    assert [s["ids"] for s in after] == [s["ids"] for s in _steps(reference)[STEPS:]]
    assert _end(resumed_at_epoch_end)["weights"] == _end(reference)["weights"]
