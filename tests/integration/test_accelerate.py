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

import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration import _jobs as job

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")
pytestmark = pytest.mark.timeout(420)

ROOT = job.ROOT
SCRIPT = ROOT / "examples" / "accelerate_train.py"

SAMPLES = 90
EPOCHS = 3
ACCUMULATE = 5
STEPS = 12  # 2 processes x 1 worker, batches of 4: 2 shards of 45 -> 12 batches per epoch each
KILL_AT = 10  # a multiple of ACCUMULATE: the accumulated gradients were applied before the save
ONE_STEPS = 23  # 1 process x 1 worker: 90 samples -> 23 batches per epoch

# ------------------------------------------------------------------------------ running jobs


def _train(folder: Path, processes: int, *args: str) -> dict[str, Any]:
    script = [str(SCRIPT), "--log", str(folder / "log.jsonl"), "--samples", str(SAMPLES)]
    script += ["--epochs", str(EPOCHS), "--accumulate", str(ACCUMULATE), "--workers", "1", *args]
    if processes == 1:
        return job.run_job([sys.executable, *script], folder)
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu"]
    launch += ["--num_processes", str(processes), "--num_machines", "1"]
    launch += ["--mixed_precision", "no", "--dynamo_backend", "no"]
    launch += ["--main_process_port", str(job.free_port())]
    return job.run_job([*launch, *script], folder)


# ------------------------------------------------------------------------------ reading runs


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
    run = job.shared("accelerate-reference", tmp_path_factory, lambda d: _train(d, 2))
    job.assert_finished(run)
    return run


@pytest.fixture
def killed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same job, save_state every 5 batches, every process SIGKILLed after step 10's: 10 of
    12 batches of epoch 0 taken on each process."""

    def make(folder: Path) -> dict[str, Any]:
        saving = ["--save-every", str(ACCUMULATE), "--ckpt-dir", str(folder / "checkpoints")]
        return _train(folder, 2, *saving, "--kill-at-step", str(KILL_AT))

    run = job.shared("accelerate-killed", tmp_path_factory, make)
    killed = job.records(run, "killed")
    assert sorted(r["rank"] for r in killed) == [0, 1], job.why(run)
    assert {r["global_step"] for r in killed} == {KILL_AT}
    assert run["returncode"] != 0
    return run


def _resumed(factory: pytest.TempPathFactory, killed: dict[str, Any], processes: int) -> Any:
    state = Path(killed["folder"]) / "checkpoints" / f"step-{KILL_AT:03d}"
    run = job.shared(
        f"accelerate-resumed-on-{processes}",
        factory,
        lambda d: _train(d, processes, "--resume", str(state)),
    )
    job.assert_finished(run)
    return run


# ------------------------------------------------------------------------------ the tests


def test_two_processes_cover_each_epoch_once_and_sync_on_its_last_batch(
    reference: dict[str, Any],
) -> None:
    """12 batches per epoch and process, accumulation over 5: the optimizer steps after batches
    5, 10 and 12, and accumulate() sees end_of_dataloader on batch 12 only, every epoch."""
    for rank in (0, 1):
        steps = job.steps(reference, rank)
        assert len(steps) == EPOCHS * STEPS
        for epoch in range(EPOCHS):
            in_epoch = [s for s in steps if s["epoch"] == epoch]
            assert _flags(in_epoch) == _sync_pattern(STEPS), f"rank {rank}, epoch {epoch}"
            assert all(s["info"]["epoch"] == epoch for s in in_epoch)
        starts = job.records(reference, "epoch_start", rank)
        assert [(r["epoch"], r["len"], r["remaining"]) for r in starts] == [
            (e, STEPS, STEPS) for e in range(EPOCHS)
        ]
        end = job.end(reference, rank)
        assert end["global_step"] == EPOCHS * STEPS
        assert [(w["traces"], w["rebuilds"]) for w in end["workers"]] == [(1, 0)]
    for epoch in range(EPOCHS):
        job.exactly_once(job.ids(job.steps(reference), epoch), SAMPLES, f"epoch {epoch}")
    assert job.end(reference, 0)["weights"] == job.end(reference, 1)["weights"]


def test_killed_job_resumes_on_one_process_exactly_once(
    tmp_path_factory: pytest.TempPathFactory, killed: dict[str, Any]
) -> None:
    """90 - 2 x 10 x 4 = 10 samples left of epoch 0: 3 batches on one process (the last one with
    2 padded rows), synced on the last; then epochs of 23 batches."""
    resumed = _resumed(tmp_path_factory, killed, processes=1)
    before, after = job.steps(killed, before=KILL_AT), job.steps(resumed)
    rest = [s for s in after if s["epoch"] == 0]
    assert len(rest) == 3
    assert _flags(rest) == [(False, False), (False, False), (True, True)]
    job.exactly_once(job.ids(before, 0) + job.ids(rest, 0), SAMPLES, "the interrupted epoch 0")
    starts = job.records(resumed, "epoch_start")
    assert [(r["epoch"], r["remaining"]) for r in starts] == [
        (0, 3),
        (1, ONE_STEPS),
        (2, ONE_STEPS),
    ]
    for epoch in range(1, EPOCHS):
        in_epoch = [s for s in after if s["epoch"] == epoch]
        assert _flags(in_epoch) == _sync_pattern(ONE_STEPS), f"epoch {epoch}"
        job.exactly_once(job.ids(in_epoch, epoch), SAMPLES, f"epoch {epoch} after the resume")
    assert job.end(resumed)["global_step"] == KILL_AT + 3 + 2 * ONE_STEPS


def test_killed_job_resumes_on_two_processes_with_the_uninterrupted_stream(
    tmp_path_factory: pytest.TempPathFactory,
    reference: dict[str, Any],
    killed: dict[str, Any],
) -> None:
    resumed = _resumed(tmp_path_factory, killed, processes=2)
    for rank in (0, 1):
        before, after = job.steps(killed, rank, before=KILL_AT), job.steps(resumed, rank)
        uninterrupted = job.steps(reference, rank)
        assert [s["global_step"] for s in after] == list(range(KILL_AT, EPOCHS * STEPS))
        assert [s["ids"] for s in before + after] == [s["ids"] for s in uninterrupted], (
            f"rank {rank}: the resumed stream is not the uninterrupted one"
        )
        assert _flags(before + after) == _flags(uninterrupted), f"rank {rank}: other syncs"
        first = job.records(resumed, "epoch_start", rank)[0]
        assert (first["epoch"], first["len"], first["remaining"]) == (0, STEPS, STEPS - KILL_AT)
        assert job.end(resumed, rank)["weights"] == job.end(reference, rank)["weights"]
    everything = job.steps(killed, before=KILL_AT) + job.steps(resumed)
    for epoch in range(EPOCHS):
        job.exactly_once(job.ids(everything, epoch), SAMPLES, f"epoch {epoch} over both runs")
    # register_for_checkpointing(loader, ...): the loader's state is the first custom object
    saved = Path(killed["folder"]) / "checkpoints" / f"step-{KILL_AT:03d}"
    state = torch.load(saved / "custom_checkpoint_0.pkl", weights_only=False)
    assert (state["epoch"], state["layout"]["world_size"], state["received"]) == (0, 2, [10, 10])
