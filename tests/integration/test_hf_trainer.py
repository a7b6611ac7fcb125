"""The real ``transformers.Trainer`` over loaders (``loader.hf.LoaderTrainer``, driven through
``examples/hf_trainer.py``): a job SIGKILLed right after a mid-epoch checkpoint resumes with
``train(resume_from_checkpoint=True)`` to byte-identical batches and equal weights, with and
without gradient accumulation, on the newest transformers installed and on the oldest that the
extras allow (installed once into a cache directory and put first on the job's path: it has no
``Trainer.get_resumed_dataloader``); ``evaluate()`` predicts each of the dataset's samples once;
``evaluate(eval_dataset=loader)`` and ``predict(loader)`` take a loader, and ``batch.info``
reaches ``compute_loss`` and ``prediction_step``; a checkpoint of another world size, or one
without the loader's state, is refused with what to do.
"""

from __future__ import annotations

import fcntl
import functools
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from packaging.version import Version

from loader import Loader
from tests import pipelines as P
from tests.integration.test_worker_server import clean_env

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(400)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "hf_trainer.py"
SAMPLES = 100  # 7 batches of 16 per epoch, the last one 4 real rows and 12 padded
EPOCHS = 2
UNEVEN = 101  # on 2 ranks: 51 and 50
KILL_AT = 3  # a mid-epoch checkpoint (epoch 0 has 7 batches: 7 or 4 optimizer steps)


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from loader.sample import write_sample_dataset

    return write_sample_dataset(tmp_path_factory.mktemp("hf") / "images", SAMPLES, classes=4)


def _run(
    images: Path, out: Path, log: Path, *args: str, path: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """The example as a job; ``path``, when given, goes first on its ``PYTHONPATH``."""
    command = [sys.executable, str(SCRIPT), "--data", str(images), "--out", str(out)]
    command += ["--events", str(log), "--epochs", str(EPOCHS), "--save-steps", str(KILL_AT), *args]
    env = clean_env()
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(path), env["PYTHONPATH"]])
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


def _records(log: Path, event: str) -> list[dict[str, Any]]:
    lines = log.read_text().splitlines() if log.exists() else []
    return [r for r in map(json.loads, lines) if r["event"] == event]


# ------------------------------------------------------------ the oldest transformers allowed
def _transformers_requirement(extra: str) -> Any:
    """The installed package's requirement on transformers for ``extra``."""
    from packaging.requirements import Requirement

    for line in importlib.metadata.requires("dali-capture-loader") or []:
        requirement = Requirement(line)
        if requirement.name == "transformers" and (
            requirement.marker is not None and requirement.marker.evaluate({"extra": extra})
        ):
            return requirement
    raise AssertionError(f"the extra {extra!r} of dali-capture-loader requires no transformers")


def oldest_allowed() -> str:
    """The oldest transformers the extras allow: the ``>=`` of the ``hf`` extra (``test`` states
    the same range)."""
    hf = _transformers_requirement("hf")
    assert str(hf.specifier) == str(_transformers_requirement("test").specifier)
    floors = [spec.version for spec in hf.specifier if spec.operator == ">="]
    assert len(floors) == 1, f"{hf}: one lower bound expected"
    return str(floors[0])


def _distribution(name: str, path: list[str]) -> importlib.metadata.Distribution | None:
    """The distribution ``name`` that an import over ``path`` finds (the first one on it)."""
    return next(iter(importlib.metadata.distributions(name=name, path=path)), None)


def _unmet(target: Path) -> list[str]:
    """The requirements of the transformers in ``target`` (its own, not its extras') that a job
    with ``target`` first on its path, then this environment's, does not meet."""
    from packaging.requirements import Requirement

    path = [str(target), *sys.path]
    transformers = _distribution("transformers", [str(target)])
    assert transformers is not None, f"no transformers in {target}"
    unmet = []
    for line in transformers.requires or []:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue  # an extra's, or another platform's
        found = _distribution(requirement.name, path)
        if found is None or not requirement.specifier.contains(found.version, prereleases=True):
            unmet.append(f"{requirement.name}{requirement.specifier}")
    return unmet


_UNREACHABLE = (
    "from versions: none",
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "Name or service not known",
    "Network is unreachable",
    "ConnectTimeout",
    "Read timed out",
    "ProxyError",
    "No module named pip",
)


def _pip_install(target: Path, *requirements: str) -> None:
    """``pip install --no-deps --target target requirements``; the test is skipped where pip
    cannot reach its index."""
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target)]
    command += ["--disable-pip-version-check", "--no-input", "--retries", "1", "--timeout", "30"]
    try:
        done = subprocess.run(
            [*command, *requirements], capture_output=True, text=True, timeout=240
        )
    except subprocess.TimeoutExpired:
        pytest.skip(f"pip install {' '.join(requirements)} did not finish in 240 s (no index?)")
    output = done.stdout + done.stderr
    if done.returncode != 0 and any(sign in output for sign in _UNREACHABLE):
        pytest.skip(f"pip cannot install {' '.join(requirements)} (no index?): {output[-500:]}")
    assert done.returncode == 0, output[-3000:]


@pytest.fixture(scope="module")
def oldest_transformers() -> Iterator[tuple[Path, str]]:
    """A directory with the oldest transformers the extras allow (and any of its requirements
    that this environment does not meet), for the front of a job's ``PYTHONPATH``; and that
    version. Installed once into the user's cache, under a lock (two test processes, or two
    sessions, may ask at once) and into a temporary directory renamed when complete (a killed
    install leaves no half of one)."""
    floor = oldest_allowed()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    cache = Path(base) / "dali-capture-loader" / "transformers"
    cache.mkdir(parents=True, exist_ok=True)
    tag = f"py{sys.version_info[0]}{sys.version_info[1]}-{sysconfig.get_platform()}"
    target = cache / f"transformers-{floor}-{tag}"
    with open(cache / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_dir() and _distribution("transformers", [str(target)]) is None:
            shutil.rmtree(target)  # not what this fixture left there: made again
        if not target.is_dir():
            partial = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=cache))
            partial.chmod(0o755)
            try:
                _pip_install(partial, f"transformers=={floor}")
                os.rename(partial, target)
            finally:
                shutil.rmtree(partial, ignore_errors=True)
        unmet = _unmet(target)
        if unmet:  # installed beside it: the job finds them before this environment's
            _pip_install(target, *unmet)
            assert not _unmet(target), _unmet(target)
    installed = _distribution("transformers", [str(target)])
    assert installed is not None and Version(installed.version) == Version(floor), installed
    yield target, installed.version


@pytest.mark.parametrize(
    ("accumulate", "transformers"),
    # the oldest with gradient accumulation only: its steps hold 2 batches, so a fast-forward
    # that skipped too many or too few batches shows in both the batches and the weights
    [(1, "newest"), (2, "newest"), (2, "oldest")],
)
def test_a_killed_trainer_resumes_to_the_same_batches_and_weights(
    images: Path, tmp_path: Path, accumulate: int, transformers: str, request: pytest.FixtureRequest
) -> None:
    """On the transformers installed (the newest the extras allow, as pip resolves them; 5.25 and
    later fast-forward through ``get_resumed_dataloader``) and on the oldest they allow (5.20,
    which calls accelerate's ``skip_first_batches`` by its name in ``transformers.trainer``)."""
    path: Path | None = None
    version = importlib.metadata.version("transformers")
    if transformers == "oldest":
        path, version = request.getfixturevalue("oldest_transformers")
        if version == importlib.metadata.version("transformers"):
            pytest.skip(f"the transformers installed is the oldest allowed, {version}: tested")
    run = functools.partial(_run, images, path=path)
    steps = f"--accumulate={accumulate}"
    full = run(tmp_path / "full", tmp_path / "full.jsonl", steps)
    assert full.returncode == 0, full.stderr[-3000:]
    killed = run(
        tmp_path / "run", tmp_path / "killed.jsonl", steps, "--no-eval",
        "--kill-after-save", str(KILL_AT),
    )  # fmt: skip
    assert killed.returncode == -9, killed.stderr[-3000:]
    checkpoint = tmp_path / "run" / f"checkpoint-{KILL_AT}"
    assert (checkpoint / "loader_state.json").is_file()
    resumed = run(tmp_path / "run", tmp_path / "resumed.jsonl", steps, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for log in ("full.jsonl", "killed.jsonl", "resumed.jsonl"):  # each job ran that version
        assert [r["transformers"] for r in _records(tmp_path / log, "start")] == [version]

    def batches(log: str) -> dict[tuple[int, int], str]:
        return {(r["epoch"], r["step"]): r["digest"] for r in _records(tmp_path / log, "batch")}

    uninterrupted = batches("full.jsonl")
    assert len(uninterrupted) == EPOCHS * 7
    before, after = batches("killed.jsonl"), batches("resumed.jsonl")
    trained_before = KILL_AT * accumulate
    assert sorted(after) == sorted(uninterrupted)[trained_before:], "no batch twice, none lost"
    assert {**before, **after} == uninterrupted, "the same bytes, random crops and flips included"
    first = _records(tmp_path / "resumed.jsonl", "batch")[0]
    assert first["global_step"] == KILL_AT
    weights = [r["weights"] for r in _records(tmp_path / "full.jsonl", "end")]
    assert weights == [r["weights"] for r in _records(tmp_path / "resumed.jsonl", "end")]
    # evaluation: each sample predicted once, though the last batch of the epoch was padded
    for log in ("full.jsonl", "resumed.jsonl"):
        (evaluated,) = _records(tmp_path / log, "eval")
        assert evaluated["ids"] == list(range(SAMPLES))
        (end,) = _records(tmp_path / log, "end")
        assert end["metrics"]["eval_rows"] == SAMPLES


def test_gradient_accumulation_past_the_loaders_slots_is_told_before_training(
    images: Path, tmp_path: Path
) -> None:
    """Trainer fetches a step's batches before it drops the last step's: with 4 of them and
    one worker of 4 slots, training stopped after its first optimizer step with a
    SlotsExhaustedError. Told before training, with the prefetch that suffices, which does."""
    run = functools.partial(_run, images, path=None)
    args = ("--accumulate=4", "--workers=1", "--no-eval")
    told = run(tmp_path / "told", tmp_path / "told.jsonl", *args)
    assert told.returncode != 0
    assert "gradient_accumulation_steps=4" in told.stderr
    assert "prefetch=5 (or more), or copy=True" in told.stderr
    assert not _records(tmp_path / "told.jsonl", "batch")  # (before any step)
    trained = run(tmp_path / "ran", tmp_path / "ran.jsonl", *args, "--prefetch=5")
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert len(_records(tmp_path / "ran.jsonl", "batch")) == EPOCHS * 7


EVALUATED = 10  # ids in batches of 4: 4, 4 and 2 rows (cut_padding=True)


def id_model() -> Any:
    """A model of the batch's ``id`` key alone: its loss their mean, its prediction the ids."""
    import torch

    class Model(torch.nn.Module):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(()))

        def forward(self, id: Any) -> dict[str, Any]:  # the batch's keys, nothing else
            ids = id.reshape(-1)
            return {"loss": (self.weight * ids).float().mean(), "ids": ids}

    return Model


def test_evaluate_and_predict_take_a_loader_and_batch_info_reaches_the_steps(
    tmp_path: Path,
) -> None:
    """In this process: ``evaluate()`` (the ``eval_loader``), ``evaluate(eval_dataset=loader)``
    and ``predict(loader)`` each go over the loader's samples once; ``prediction_step`` gets the
    batch with its ``info`` and so does ``compute_loss`` (after Trainer's device transfer); the
    model is called with the batch's keys only."""
    pytest.importorskip("torch")
    from accelerate.state import AcceleratorState, GradientState
    from transformers import TrainingArguments

    from loader.hf import LoaderTrainer

    seen: dict[str, list[Any]] = {"prediction_step": [], "compute_loss": []}

    Model = id_model()

    class Recorder(LoaderTrainer):
        def prediction_step(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            seen["prediction_step"].append((inputs.info.step, inputs.info.cut))
            return super().prediction_step(model, inputs, *args, **kwargs)

        def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            seen["compute_loss"].append((inputs.info.step, len(inputs["id"])))
            return super().compute_loss(model, inputs, *args, **kwargs)

    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_eval_batch_size=4,
        report_to=[],
        use_cpu=True,
        dataloader_pin_memory=False,
        label_names=["id"],
    )
    source = functools.partial(P.sample_source, total=EVALUATED)
    try:
        with Loader(
            source, P.cast_step, batch_size=4, num_workers=1, output="torch", cut_padding=True
        ) as loader:
            trainer = Recorder(model=Model(), args=args, eval_loader=loader)
            assert set(trainer.evaluate()) >= {"eval_loss", "eval_runtime"}
            assert seen["prediction_step"] == [(0, 0), (1, 0), (2, 2)]
            assert seen["compute_loss"] == [(0, 4), (1, 4), (2, 2)]
            again = trainer.evaluate(eval_dataset=loader, metric_key_prefix="again")
            assert set(again) >= {"again_loss", "again_runtime"}
            prediction = trainer.predict(loader)
            del trainer
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    assert sorted(np.ravel(prediction.predictions).tolist()) == list(range(EVALUATED))
    assert np.ravel(prediction.label_ids).tolist() == np.ravel(prediction.predictions).tolist()
    assert set(prediction.metrics) >= {"test_loss", "test_runtime"}
    assert len(seen["prediction_step"]) == 9  # 3 batches, 3 times


def test_predict_takes_no_row_of_a_batch_of_padding_alone(tmp_path: Path) -> None:
    """3 samples, batches of 4, 2 workers: the second worker has no sample of its own and
    yields a batch of padding (its one row kept by ``cut_padding=True``, flagged ``padded``);
    it was predicted as a fourth row, a repeat."""
    pytest.importorskip("torch")
    from accelerate.state import AcceleratorState, GradientState
    from transformers import TrainingArguments

    from loader.hf import LoaderTrainer

    args = TrainingArguments(
        output_dir=str(tmp_path),
        report_to=[],
        use_cpu=True,
        dataloader_pin_memory=False,
        label_names=["id"],
    )
    source = functools.partial(P.sample_source, total=3)
    try:
        with Loader(
            source, P.cast_step, batch_size=4, num_workers=2, output="torch", cut_padding=True
        ) as loader:
            assert [batch.info.padded for batch in loader] == [0, 1]
            prediction = LoaderTrainer(model=id_model()(), args=args).predict(loader)
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    assert sorted(np.ravel(prediction.predictions).tolist()) == [0, 1, 2]
    assert np.ravel(prediction.label_ids).tolist() == np.ravel(prediction.predictions).tolist()


def test_a_checkpoint_without_the_loaders_state_or_of_another_world_size_is_refused(
    tmp_path: Path,
) -> None:
    from loader.hf import check_world_size, read_state, write_state

    with pytest.raises(ValueError, match="not saved by a LoaderTrainer"):
        read_state(str(tmp_path))
    write_state(str(tmp_path / "checkpoint-4"), {"layout": {"world_size": 2, "num_workers": 2}})
    state = read_state(str(tmp_path / "checkpoint-4"))
    check_world_size(state, 2, "checkpoint-4")
    with pytest.raises(ValueError, match=r"saved on 2 rank\(s\), this job has 1.*Resume on 2"):
        check_world_size(state, 1, "checkpoint-4")


def _torchrun(images: Path, out: Path, log: Path, *args: str) -> subprocess.CompletedProcess[str]:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    launcher += ["--nproc_per_node=2", str(SCRIPT), "--data", str(images), "--out", str(out)]
    launcher += ["--events", str(log), "--epochs", str(EPOCHS), "--save-steps", str(KILL_AT)]
    env = {**clean_env(), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [*launcher, "--workers", "1", *args], capture_output=True, text=True, timeout=300, env=env
    )


def test_two_ranks_under_torchrun_resume_exactly_and_evaluate_each_sample_once(
    tmp_path: Path,
) -> None:
    """2 ranks (gloo, CPU) over 101 images (51 and 50: the ranks' last batches hold 3 and 2 real
    rows): the same batches on each rank and equal weights after a kill and a resume;
    ``evaluate()`` gathers exactly the dataset's samples; the checkpoint resumed on one process
    is refused (Trainer counts steps per rank)."""
    from loader.sample import write_sample_dataset

    images = write_sample_dataset(tmp_path / "images", UNEVEN, classes=4)
    full = _torchrun(images, tmp_path / "full", tmp_path / "full.jsonl")
    assert full.returncode == 0, full.stdout[-2000:] + full.stderr[-3000:]
    killed = _torchrun(
        images, tmp_path / "run", tmp_path / "killed.jsonl", "--no-eval", "--kill-after-save", "3"
    )
    assert killed.returncode != 0
    resumed = _torchrun(images, tmp_path / "run", tmp_path / "resumed.jsonl", "--resume")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]

    def batches(log: str) -> dict[tuple[int, int, int], str]:
        records = _records(tmp_path / log, "batch")
        return {(r["rank"], r["epoch"], r["step"]): r["digest"] for r in records}

    uninterrupted = batches("full.jsonl")
    assert len(uninterrupted) == 2 * EPOCHS * 4  # 51 and 50 samples: 4 batches of 16 each
    assert {**batches("killed.jsonl"), **batches("resumed.jsonl")} == uninterrupted
    assert len(batches("resumed.jsonl")) == len(uninterrupted) - 2 * KILL_AT
    weights = {r["weights"] for r in _records(tmp_path / "full.jsonl", "end")}
    assert len(weights) == 1
    assert weights == {r["weights"] for r in _records(tmp_path / "resumed.jsonl", "end")}
    for evaluated in _records(tmp_path / "full.jsonl", "eval"):  # each rank gathers them all
        assert evaluated["ids"] == list(range(UNEVEN))

    one = _run(images, tmp_path / "run", tmp_path / "one.jsonl", "--resume")
    assert one.returncode != 0
    assert "was saved on 2 rank(s), this job has 1" in one.stderr
