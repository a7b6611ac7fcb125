"""Preemption as clusters do it: a real signal to the job's whole process group (SLURM's
``scancel`` and time limit send SIGTERM to every process; ``--signal`` sends SIGUSR1 or SIGUSR2
ahead of it). The workers and the worker server leave the signal to their trainer: a trainer
that handles it finishes its step (with gradient accumulation: the batches that complete the
optimizer step in progress), saves ``state_dict()`` and exits 0, nothing of the job is
left, and the resumed epoch is exactly once. A trainer without a handler dies of the signal, and
its workers and server follow it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.test_worker_server import clean_env

pytestmark = pytest.mark.timeout(240)

TOTAL = 400

TRAINER = """
import json, os, pickle, signal, sys, time
import functools
from loader import Loader
from tests import pipelines as P

SOURCE = functools.partial(P.sample_source, total={total})
stop = []

if __name__ == "__main__":
    state_file, seen_file, handle = sys.argv[1], sys.argv[2], sys.argv[3] == "handle"
    if handle:  # the trainer's own handler (a module's top level would run in workers too)
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(signum, lambda signum, frame: stop.append(signum))
    resumed = os.path.exists(state_file)
    with Loader(SOURCE, P.cast_step, batch_size=4, num_workers=2) as loader:
        if resumed:
            with open(state_file, "rb") as f:
                loader.load_state_dict(pickle.load(f))
        seen = []
        for batch in loader:
            rows = P.ids_of(batch)
            seen += rows[: len(rows) - batch.info.padded]
            time.sleep(0.01)  # the training step
            if len(seen) == 20 and not resumed:  # mid-way through an optimizer step
                print("ready", flush=True)
            # with gradient accumulation (16 batches), a trainer saves at an optimizer step:
            # after a signal it still takes the batches that complete the step in progress
            if stop and len(seen) % 64 == 0:
                with open(state_file, "wb") as f:
                    pickle.dump(loader.state_dict(), f)
                with open(seen_file, "w") as f:
                    json.dump({{"seen": seen, "signal": stop[0]}}, f)
                sys.exit(0)
    with open(seen_file, "w") as f:
        json.dump({{"seen": seen, "signal": None}}, f)
"""


def _group_gone(group: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def _start(script: Path, tmp_path: Path, mode: str, name: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "state.pkl"), str(tmp_path / name), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
        start_new_session=True,  # its own process group, as a job's under a cluster manager
    )


def _signal_when_ready(trainer: subprocess.Popen[str], signum: int) -> None:
    assert trainer.stdout is not None
    line = trainer.stdout.readline()
    assert line.strip() == "ready", line + (trainer.stderr.read() if trainer.stderr else "")
    group = os.getpgid(trainer.pid)
    members = [pid for pid in _pids() if _pgid(pid) == group]
    assert len(members) >= 4, members  # the trainer, its server and two workers
    os.killpg(group, signum)


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_to_the_process_group_lets_the_trainer_save_and_resume_exactly(
    tmp_path: Path, signum: int
) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAINER.format(total=TOTAL))
    trainer = _start(script, tmp_path, "handle", "first.json")
    try:
        _signal_when_ready(trainer, signum)
        _out, err = trainer.communicate(timeout=120)
    finally:
        trainer.kill()
    assert trainer.returncode == 0, err[-3000:]
    assert _group_gone(trainer.pid, 20), "a process of the job outlived its trainer"
    first = json.loads((tmp_path / "first.json").read_text())
    assert first["signal"] == signum and 20 <= len(first["seen"]) < TOTAL

    again = _start(script, tmp_path, "handle", "second.json")
    _out, err = again.communicate(timeout=120)
    assert again.returncode == 0, err[-3000:]
    second = json.loads((tmp_path / "second.json").read_text())
    assert second["signal"] is None
    assert sorted(first["seen"] + second["seen"]) == list(range(TOTAL)), "not exactly once"
    assert _group_gone(again.pid, 20)


def test_a_trainer_without_a_handler_dies_of_the_signal_and_its_workers_follow(
    tmp_path: Path,
) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAINER.format(total=TOTAL))
    trainer = _start(script, tmp_path, "default", "first.json")
    try:
        _signal_when_ready(trainer, signal.SIGTERM)
        trainer.communicate(timeout=60)
    finally:
        trainer.kill()
    assert trainer.returncode == -signal.SIGTERM
    assert _group_gone(trainer.pid, 20), "a worker or the server outlived its killed trainer"
    assert not (tmp_path / "state.pkl").exists()


LIGHTNING_JOB = """
import functools, json, sys, time
from tests import pipelines as P

SOURCE = functools.partial(P.sample_source, total={total})


def main(log_path, root):
    import lightning as L
    import torch
    from lightning.pytorch.plugins.environments import SLURMEnvironment
    from loader import Loader

    def log(record):
        with open(log_path, "a") as f:
            f.write(json.dumps(record) + "\\n")

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def training_step(self, batch, batch_idx):
            ids = batch["id"].reshape(-1)
            log({{"event": "batch", "epoch": batch.info.epoch,
                  "ids": ids[: len(ids) - batch.info.padded].tolist()}})
            time.sleep(0.1)
            return self.layer(batch["id"].float()).sum()

        def on_save_checkpoint(self, checkpoint):
            log({{"event": "saved"}})

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    with Loader(SOURCE, P.cast_step, batch_size=4, num_workers=2, output="torch") as loader:
        trainer = L.Trainer(
            max_epochs=2, accelerator="cpu", devices=1, default_root_dir=root,
            plugins=[SLURMEnvironment(auto_requeue=True)], use_distributed_sampler=False,
            enable_checkpointing=False, enable_progress_bar=False, logger=False,
        )
        log({{"event": "start"}})
        trainer.fit(Module(), train_dataloaders=loader)
        log({{"event": "end"}})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
"""

SLURM_ENV = {
    "SLURM_NTASKS": "1",
    "SLURM_NTASKS_PER_NODE": "1",
    "SLURM_JOB_NAME": "train",
    "SLURM_JOB_ID": "4242",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_NODELIST": "localhost",
}


def test_lightnings_slurm_requeue_handler_saves_with_the_workers_alive(tmp_path: Path) -> None:
    """Lightning's own SLURM handler (``SLURMEnvironment(auto_requeue=True)``): SIGUSR1 to the
    job's process group makes it save ``hpc_ckpt_1.ckpt`` (the loader's state inside) and call
    ``scontrol requeue`` (a stand-in on PATH records the call); training goes on with the
    workers alive until the cluster's SIGKILL. The requeued job restores that checkpoint by
    itself, and each epoch is delivered exactly once over the two runs."""
    pytest.importorskip("lightning")
    total = 480
    (tmp_path / "job.py").write_text(LIGHTNING_JOB.format(total=total))
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "requeued"}\n')
    (tools / "scontrol").chmod(0o755)
    env = {**clean_env(), **SLURM_ENV, "PATH": f"{tools}:{os.environ['PATH']}"}
    log, root = tmp_path / "log.jsonl", tmp_path / "root"
    command = [sys.executable, str(tmp_path / "job.py"), str(log), str(root)]

    def events() -> list[dict[str, object]]:
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    def wait_for(condition: object, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not condition():  # type: ignore[operator]
            assert time.monotonic() < deadline, events()[-3:]
            time.sleep(0.1)

    job = subprocess.Popen(command, env=env, start_new_session=True, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: sum(e["event"] == "batch" for e in events()) >= 20, 120)
        os.killpg(job.pid, signal.SIGUSR1)
        wait_for(lambda: (tmp_path / "requeued").exists(), 60)
        saved_at = len(events())
        wait_for(lambda: len(events()) >= saved_at + 5, 30)  # training goes on after the save
        assert job.poll() is None, "the job died of the signal"
    finally:
        os.killpg(job.pid, signal.SIGKILL)  # the cluster, after the requeue
        job.communicate(timeout=30)
    assert _group_gone(job.pid, 20)
    assert (tmp_path / "requeued").read_text().split() == ["requeue", "4242"]
    assert (root / "hpc_ckpt_1.ckpt").is_file()

    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    runs: list[list[dict[str, object]]] = []
    for event in events():
        if event["event"] == "start":
            runs.append([])
        runs[-1].append(event)
    first, second = runs
    first = first[: next(i for i, e in enumerate(first) if e["event"] == "saved")]
    for epoch in range(2):
        ids = [
            i
            for e in first + second
            if e["event"] == "batch" and e["epoch"] == epoch
            for i in e["ids"]  # type: ignore[attr-defined]
        ]
        assert sorted(ids) == list(range(total)), f"epoch {epoch} not exactly once"
