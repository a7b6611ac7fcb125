"""The real ``transformers.Trainer`` over loaders (``loader.hf.LoaderTrainer``, driven through
``examples/hf_trainer.py``): a job SIGKILLed right after a mid-epoch checkpoint resumes with
``train(resume_from_checkpoint=True)`` to byte-identical batches and equal weights, with and
without gradient accumulation; ``evaluate()`` predicts each of the dataset's samples once; a
checkpoint of another world size, or one without the loader's state, is refused with what to do.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

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


def _run(images: Path, out: Path, log: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, str(SCRIPT), "--data", str(images), "--out", str(out)]
    command += ["--events", str(log), "--epochs", str(EPOCHS), "--save-steps", str(KILL_AT), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=clean_env())


def _records(log: Path, event: str) -> list[dict[str, Any]]:
    lines = log.read_text().splitlines() if log.exists() else []
    return [r for r in map(json.loads, lines) if r["event"] == event]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_killed_trainer_resumes_to_the_same_batches_and_weights(
    images: Path, tmp_path: Path, accumulate: int
) -> None:
    steps = f"--accumulate={accumulate}"
    full = _run(images, tmp_path / "full", tmp_path / "full.jsonl", steps)
    assert full.returncode == 0, full.stderr[-3000:]
    killed = _run(
        images, tmp_path / "run", tmp_path / "killed.jsonl", steps, "--no-eval",
        "--kill-after-save", str(KILL_AT),
    )  # fmt: skip
    assert killed.returncode == -9, killed.stderr[-3000:]
    checkpoint = tmp_path / "run" / f"checkpoint-{KILL_AT}"
    assert (checkpoint / "loader_state.json").is_file()
    resumed = _run(images, tmp_path / "run", tmp_path / "resumed.jsonl", steps, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]

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
