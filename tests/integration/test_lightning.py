"""Real Lightning runs (CPU; DDP over gloo) of examples/lightning_train.py: batch.info in
training_step, one trace per worker over three epochs, and jobs SIGKILLed after one of Lightning's
own checkpoints that resume from it, mid-epoch or at an epoch's end, on the same or another
number of devices, with every sample of every epoch exactly once.

The checkpoint cases (the kills and resumes) run under both of Lightning's package names,
``lightning.pytorch`` (the example's default, ``import lightning as L``) and ``pytorch_lightning``:
each job uses one of them end to end (``--lightning-package``), and says which Trainer it ran. The
others run under ``lightning.pytorch`` only.

Each run is made once per test session (under pytest-xdist too: the first test to need a run makes
it, under a file lock, and the others read its result)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from loader.sample import write_sample_dataset
from tests.integration import _jobs as job

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(420)

#: Lightning's package names, as imported: ``import lightning as L`` gives lightning.pytorch's
#: Trainer; pytorch_lightning is the same Lightning under its standalone name.
PACKAGES = ["lightning.pytorch", "pytorch_lightning"]
DEFAULT = "lightning.pytorch"

ROOT = job.ROOT
SCRIPT = ROOT / "examples" / "lightning_train.py"

SAMPLES = 93  # 1 device x 2 workers, batches of 4: 24 steps/epoch, shared 12 + 12
STEPS = 24
EPOCHS = 3
IMAGES = 48  # ddp_images; 2 ranks x 1 worker: 2 shards of 24 -> 6 steps/epoch/rank
DDP_STEPS = 6

# ------------------------------------------------------------------------------ running jobs


def _train(folder: Path, package: str, *args: str) -> dict[str, Any]:
    """The example under ``package`` (``lightning.pytorch`` or ``pytorch_lightning``)."""
    name = package.split(".")[0]  # the example's --lightning-package: lightning, pytorch_lightning
    log = ["--log", str(folder / "log.jsonl"), "--lightning-package", name]
    return job.run_job([sys.executable, str(SCRIPT), *log, *args], folder)


def _run_name(name: str, package: str) -> str:
    return f"lightning-{name}" if package == DEFAULT else f"lightning-{name}-{package}"


def _synthetic(*args: str) -> list[str]:
    return ["--samples", str(SAMPLES), "--batch-size", "4", "--epochs", str(EPOCHS), *args]


def _images(root: Path, *args: str) -> list[str]:
    return ["--data", str(root), "--batch-size", "4", "--epochs", str(EPOCHS), *args]


# ------------------------------------------------------------------------------ reading runs


def _assert_ran_under(run: dict[str, Any], package: str) -> None:
    """The job's Trainer came from ``package``, on every rank that finished."""
    trainers = {r["trainer"] for r in job.records(run, "end")}
    assert trainers, job.why(run)
    assert all(t.startswith(f"{package}.") for t in trainers), (package, trainers)


def _assert_killed(run: dict[str, Any], step: int, ranks: int) -> None:
    killed = job.records(run, "killed")
    assert sorted(r["rank"] for r in killed) == list(range(ranks)), job.why(run)
    assert {r["global_step"] for r in killed} == {step}
    assert run["returncode"] == -signal.SIGKILL


def _loader_state(checkpoint: Path) -> dict[str, Any]:
    """The loader's state in one of Lightning's checkpoints."""
    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)
    states = saved["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert len(states) == 1
    return dict(states[0])


# ------------------------------------------------------------------------------ the runs


@pytest.fixture
def package(request: pytest.FixtureRequest) -> str:
    """The package a test's jobs import Lightning from: ``lightning.pytorch`` unless the test is
    parametrized over ``PACKAGES`` (indirectly, through this fixture)."""
    name: str = getattr(request, "param", DEFAULT)
    pytest.importorskip(name)
    return name


#: the checkpoint cases: once per package
per_package = pytest.mark.parametrize("package", PACKAGES, indirect=True)


@pytest.fixture
def reference(tmp_path_factory: pytest.TempPathFactory, package: str) -> dict[str, Any]:
    """1 device x 2 workers, 3 epochs, uninterrupted."""
    run = job.shared(
        _run_name("reference", package),
        tmp_path_factory,
        lambda d: _train(d, package, *_synthetic()),
    )
    job.assert_finished(run)
    _assert_ran_under(run, package)
    return run


@pytest.fixture
def killed(tmp_path_factory: pytest.TempPathFactory, package: str) -> dict[str, Any]:
    """The same job, checkpointed every 6 steps and SIGKILLed after step 30's checkpoint: 6
    batches into epoch 1, 3 per worker."""

    def make(folder: Path) -> dict[str, Any]:
        ckpt = ["--ckpt-dir", str(folder / "checkpoints"), "--every", "6"]
        return _train(folder, package, *_synthetic(*ckpt, "--kill-at-step", "30"))

    run = job.shared(_run_name("killed", package), tmp_path_factory, make)
    _assert_killed(run, 30, ranks=1)
    return run


def _resumed(
    name: str, factory: pytest.TempPathFactory, killed: dict[str, Any], step: int, package: str
) -> Any:
    checkpoint = Path(killed["folder"]) / "checkpoints" / f"step-{step:03d}.ckpt"
    run = job.shared(
        _run_name(name, package),
        factory,
        lambda d: _train(d, package, *_synthetic("--resume", str(checkpoint))),
    )
    job.assert_finished(run)
    _assert_ran_under(run, package)
    return run


@pytest.fixture
def resumed_mid_epoch(
    tmp_path_factory: pytest.TempPathFactory, killed: dict[str, Any], package: str
) -> dict[str, Any]:
    return _resumed("resumed-30", tmp_path_factory, killed, 30, package)


@pytest.fixture
def resumed_at_epoch_end(
    tmp_path_factory: pytest.TempPathFactory, killed: dict[str, Any], package: str
) -> dict[str, Any]:
    return _resumed("resumed-24", tmp_path_factory, killed, 24, package)


@pytest.fixture
def ddp_images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """48 small JPEGs in 3 classes, as conftest's image_root, but one folder for the session under
    pytest-xdist too: a checkpoint holds the list of files it read, so the job that resumes (which
    may be another xdist worker's) must read the same paths."""

    def make(folder: Path) -> dict[str, Any]:
        return {"root": str(write_sample_dataset(folder / "images", count=48, classes=3, seed=1))}

    return Path(job.shared("lightning-images", tmp_path_factory, make)["root"])


@pytest.fixture
def ddp_killed(
    tmp_path_factory: pytest.TempPathFactory, ddp_images: Path, package: str
) -> dict[str, Any]:
    """2 ranks (DDP, gloo) x 1 worker over 48 images, a checkpoint every 2 steps, every rank
    SIGKILLed after step 4's: 4 of 6 batches of epoch 0 taken on each rank. The loader is built
    before trainer.fit, before Lightning's launcher has set up the ranks."""

    def make(folder: Path) -> dict[str, Any]:
        ckpt = ["--ckpt-dir", str(folder / "checkpoints"), "--every", "2"]
        ddp = ["--devices", "2", "--strategy", "ddp", "--workers", "1"]
        return _train(folder, package, *_images(ddp_images, *ddp, *ckpt, "--kill-at-step", "4"))

    run = job.shared(_run_name("ddp-killed", package), tmp_path_factory, make)
    _assert_killed(run, 4, ranks=2)
    return run


def _ddp_resumed(
    factory: pytest.TempPathFactory,
    killed: dict[str, Any],
    images: Path,
    devices: int,
    package: str,
) -> dict[str, Any]:
    checkpoint = Path(killed["folder"]) / "checkpoints" / "step-004.ckpt"
    layout = ["--devices", str(devices), "--workers", "1"]
    if devices > 1:
        layout += ["--strategy", "ddp"]
    args = _images(images, *layout, "--resume", str(checkpoint))
    name = _run_name(f"ddp-resumed-on-{devices}", package)
    run = job.shared(name, factory, lambda d: _train(d, package, *args))
    job.assert_finished(run)
    _assert_ran_under(run, package)
    return run


# ------------------------------------------------------------------------------ the tests
# in this order, pytest-xdist's first chunks (two tests per worker) need different runs


def test_three_epochs_trace_once_and_never_rebuild(reference: dict[str, Any]) -> None:
    """Lightning calls iter(loader) once and throws the iterator away (to check the loader is
    iterable), and never calls next() after an epoch's len(loader)-th batch: neither may abort an
    epoch, so each worker traces once and replays for all three epochs."""
    workers = job.end(reference)["workers"]
    assert len(workers) == 2
    assert [(w["traces"], w["rebuilds"]) for w in workers] == [(1, 0), (1, 0)], workers
    assert [w["steps"] for w in workers] == [EPOCHS * STEPS // 2] * 2
    assert job.end(reference)["loader_epoch"] == EPOCHS


def test_batch_info_reaches_training_step(reference: dict[str, Any]) -> None:
    """Lightning moves the batch to the device (move_data_to_device) between the loader and
    training_step; batch.info must survive it."""
    steps = job.steps(reference)
    lost = [s["global_step"] for s in steps if s["info"] is None]
    assert not lost, f"batch.info missing in training_step at {len(lost)} of {len(steps)} steps"
    for s in steps:
        info = s["info"]
        assert info == s["info_before_transfer"]
        assert info["epoch"] == s["epoch"], "the loader's epoch is not Lightning's"
        assert info["step"] == s["batch_idx"], "info.step is not the rank's step in the epoch"
        assert info["worker_step"] == s["batch_idx"] // 2  # round robin over 2 workers
        assert info["worker"] == s["batch_idx"] % 2
        assert info["shard"] == info["worker"]
    # 93 samples in 24 batches of 4: only the epoch's last batch has padded rows, 3 of them
    assert {s["padded"] for s in steps if s["batch_idx"] == STEPS - 1} == {3}
    assert {s["padded"] for s in steps if s["batch_idx"] < STEPS - 1} == {0}


@per_package
def test_ddp_killed_job_resumes_on_two_devices(
    tmp_path_factory: pytest.TempPathFactory,
    ddp_killed: dict[str, Any],
    ddp_images: Path,
    package: str,
) -> None:
    resumed = _ddp_resumed(tmp_path_factory, ddp_killed, ddp_images, 2, package)
    before, after = job.steps(ddp_killed, before=4), job.steps(resumed)
    job.exactly_once(job.ids(before, 0) + job.ids(after, 0), IMAGES, "the interrupted epoch 0")
    for epoch in range(1, EPOCHS):
        job.exactly_once(job.ids(after, epoch), IMAGES, f"epoch {epoch} after the resume")
    for rank in (0, 1):
        steps = [s["global_step"] for s in after if s["rank"] == rank]
        assert steps == list(range(4, EPOCHS * DDP_STEPS)), f"rank {rank} took steps {steps}"
        assert job.end(resumed, rank)["global_step"] == EPOCHS * DDP_STEPS
        assert {s["len"] for s in after if s["rank"] == rank and s["epoch"] == 0} == {DDP_STEPS}
    assert {s["world_size"] for s in after} == {2}
    assert all(s["info"] is not None for s in after)
    # the rank's step in the epoch, counting the batches received before the resume
    assert all(s["info"]["step"] == s["batch_idx"] for s in after)
    state = _loader_state(Path(ddp_killed["folder"]) / "checkpoints" / "step-004.ckpt")
    assert (state["epoch"], state["layout"]["world_size"], state["received"]) == (0, 2, [4, 4])


@per_package
def test_ddp_killed_job_resumes_on_one_device(
    tmp_path_factory: pytest.TempPathFactory,
    ddp_killed: dict[str, Any],
    ddp_images: Path,
    package: str,
) -> None:
    """48 - 2 ranks x 4 batches x 4 = 16 samples left of epoch 0: 4 batches on one device. 4
    received + 4 left is shorter than this layout's epochs of 12 batches, and Lightning keeps
    the length it reads after the resume for every later epoch: len(loader) is 12 throughout,
    and the resumed epoch ends after its 4 batches (Lightning stops cleanly at the iterator's
    end). With len() = 8 epochs 1 and 2 lost 16 of their 48 samples each."""
    resumed = _ddp_resumed(tmp_path_factory, ddp_killed, ddp_images, 1, package)
    before, after = job.steps(ddp_killed, before=4), job.steps(resumed)
    job.exactly_once(job.ids(before, 0) + job.ids(after, 0), IMAGES, "the interrupted epoch 0")
    for epoch in range(1, EPOCHS):
        job.exactly_once(job.ids(after, epoch), IMAGES, f"epoch {epoch} after the resume")
    assert [s["global_step"] for s in after] == list(range(4, 4 + 4 + 2 * 12)), (
        f"the resumed run took steps {[s['global_step'] for s in after]}"
    )
    assert {s["len"] for s in after} == {12}
    assert job.end(resumed)["global_step"] == 4 + 4 + 2 * 12
    assert all(s["info"]["step"] == s["batch_idx"] for s in after)  # 4.. in the resumed epoch


def test_every_epoch_is_the_dataset_once_and_len_is_the_epoch(reference: dict[str, Any]) -> None:
    steps = job.steps(reference)
    assert len(steps) == EPOCHS * STEPS
    assert job.end(reference)["global_step"] == EPOCHS * STEPS
    for epoch in range(EPOCHS):
        job.exactly_once(job.ids(steps, epoch), SAMPLES, f"epoch {epoch}")
        assert [s["len"] for s in steps if s["epoch"] == epoch] == [STEPS] * STEPS
    starts = job.records(reference, "epoch_start")
    assert [(r["epoch"], r["len"], r["batches"]) for r in starts] == [
        (e, STEPS, STEPS) for e in range(EPOCHS)
    ]


@per_package
def test_killed_mid_epoch_resumes_from_lightnings_checkpoint_exactly_once(
    reference: dict[str, Any], killed: dict[str, Any], resumed_mid_epoch: dict[str, Any]
) -> None:
    before, after = job.steps(killed, before=30), job.steps(resumed_mid_epoch)
    assert [s["global_step"] for s in before] == list(range(30))
    job.exactly_once(job.ids(before, 1) + job.ids(after, 1), SAMPLES, "the interrupted epoch 1")
    for epoch in range(2, EPOCHS):
        job.exactly_once(job.ids(after, epoch), SAMPLES, f"epoch {epoch} after the resume")
    assert [s["global_step"] for s in after] == list(range(30, EPOCHS * STEPS)), (
        f"the resumed run took {len(after)} steps, the uninterrupted one "
        f"{EPOCHS * STEPS - 30} after step 30"
    )
    assert job.end(resumed_mid_epoch)["global_step"] == job.end(reference)["global_step"]
    # len(loader) in the resumed epoch: the epoch's full length (received before + left)
    assert {s["len"] for s in after if s["epoch"] == 1} == {STEPS}
    # Lightning stored the loader's state in its checkpoint: 3 batches of each worker received
    state = _loader_state(Path(killed["folder"]) / "checkpoints" / "step-030.ckpt")
    assert (state["epoch"], state["received"]) == (1, [3, 3])
    # same layout: the uninterrupted stream, batch for batch, and so the same weights
    assert [s["ids"] for s in before + after] == [s["ids"] for s in job.steps(reference)]
    assert [s["info"] for s in after] == [s["info"] for s in job.steps(reference)[30:]]
    assert job.end(resumed_mid_epoch)["weights"] == job.end(reference)["weights"]


@per_package
def test_checkpoint_at_an_epochs_last_batch_resumes_with_the_next_epoch(
    reference: dict[str, Any], killed: dict[str, Any], resumed_at_epoch_end: dict[str, Any]
) -> None:
    """Step 24 is epoch 0's last batch; Lightning saved it in on_train_batch_end, without another
    next(): the state is epoch 1 with nothing received, and the resume runs epochs 1 and 2."""
    after = job.steps(resumed_at_epoch_end)
    assert "No training batches" not in resumed_at_epoch_end["output"]
    assert [s["global_step"] for s in after] == list(range(STEPS, EPOCHS * STEPS)), (
        f"the run resumed at epoch 0's end took {len(after)} steps, not {2 * STEPS}"
    )
    for epoch in range(1, EPOCHS):
        job.exactly_once(job.ids(after, epoch), SAMPLES, f"epoch {epoch} after the resume")
    assert job.end(resumed_at_epoch_end)["global_step"] == EPOCHS * STEPS
    state = _loader_state(Path(killed["folder"]) / "checkpoints" / "step-024.ckpt")
    assert (state["epoch"], state["received"]) == (1, [0, 0])
    assert [s["ids"] for s in after] == [s["ids"] for s in job.steps(reference)[STEPS:]]
    assert job.end(resumed_at_epoch_end)["weights"] == job.end(reference)["weights"]
