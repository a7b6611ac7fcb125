"""Real torchrun launches (CPU, gloo) of examples/train_ddp.py: coverage, equal steps, agreement,
and jobs killed with SIGKILL after a checkpoint that resume on the same or another layout."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_ddp.py"


@pytest.fixture(scope="module")
def ddp_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from loader.sample import write_sample_dataset

    return write_sample_dataset(tmp_path_factory.mktemp("ddp"), count=50, classes=3, seed=2)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env["PYTHONPATH"] = str(ROOT)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _command(launcher_args: list[str], script_args: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *launcher_args,
        str(SCRIPT),
        *script_args,
    ]


def _launch(launcher_args: list[str], script_args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        _command(launcher_args, script_args),
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(proc: subprocess.Popen[str], timeout: float = 180) -> tuple[int, str]:
    output, _ = proc.communicate(timeout=timeout)
    return proc.returncode, output


def _records(out: Path, world: int) -> list[dict[str, Any]]:
    """What each rank of a run saw (see examples/train_ddp.py --out)."""
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _check_records(out: Path, world: int, total: int, epochs: int) -> None:
    records = _records(out, world)
    for epoch in range(epochs):
        steps = {rec["epochs"][epoch]["steps"] for rec in records}
        assert len(steps) == 1, f"ranks took different numbers of steps: {steps}"
        assert steps == {records[0]["epochs"][epoch]["len"]}
        per_rank = [set(rec["epochs"][epoch]["ids"]) for rec in records]
        everything = [i for rec in records for i in rec["epochs"][epoch]["ids"]]
        assert sorted(everything) == list(range(total)), "not exactly once"
        for a in range(world):
            for b in range(a + 1, world):
                assert not per_rank[a] & per_rank[b]


def test_standalone_two_ranks_cover_the_data_once(ddp_data: Path, tmp_path: Path) -> None:
    proc = _launch(
        ["--standalone", "--nproc_per_node=2"],
        ["--data", str(ddp_data), "--out", str(tmp_path), "--batch-size", "4"],
    )
    code, output = _finish(proc)
    assert code == 0, output
    _check_records(tmp_path, world=2, total=50, epochs=2)


def test_a_killed_worker_heals_without_changing_any_ranks_steps(
    ddp_data: Path, tmp_path: Path
) -> None:
    proc = _launch(
        ["--standalone", "--nproc_per_node=2"],
        [
            "--data",
            str(ddp_data),
            "--out",
            str(tmp_path),
            "--batch-size",
            "4",
            "--max-restarts",
            "1",
            "--kill-worker-at",
            "3",
        ],
    )
    code, output = _finish(proc)
    assert code == 0, output
    _check_records(tmp_path, world=2, total=50, epochs=2)
    restarts = [json.loads((tmp_path / f"rank{r}.json").read_text())["restarts"] for r in (0, 1)]
    assert restarts == [0, 1]
    assert "replaced it with a new process" in output


def test_two_nodes_on_one_machine(ddp_data: Path, tmp_path: Path) -> None:
    port = _free_port()
    common = [
        "--nnodes=2",
        "--nproc_per_node=1",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{port}",
        f"--rdzv_id=test-{os.getpid()}-{port}",
    ]
    script = ["--data", str(ddp_data), "--out", str(tmp_path), "--batch-size", "4"]
    nodes = [_launch([*common, f"--node_rank={n}"], script) for n in range(2)]
    results = [_finish(node) for node in nodes]
    for code, output in results:
        assert code == 0, output
    _check_records(tmp_path, world=2, total=50, epochs=2)


def test_mismatched_batch_size_fails_on_every_rank(ddp_data: Path, tmp_path: Path) -> None:
    started = time.monotonic()
    proc = _launch(
        ["--standalone", "--nproc_per_node=2"],
        ["--data", str(ddp_data), "--batch-size", "4", "--batch-size-on-rank", "1=8"],
    )
    code, output = _finish(proc)
    elapsed = time.monotonic() - started
    assert code != 0
    # both ranks raise the same error naming rank 1 and the field
    assert output.count("rank 1 disagrees with rank 0") >= 2, output
    assert "batch_size: rank 1 has 8, rank 0 has 4" in output
    assert elapsed < 120


# ---------------------------------------------------------------------------- killed and resumed


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _kill_job(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL torchrun and its trainers, as when a node dies, then wait until every process of
    the job is gone. torchrun starts each trainer in a session of its own, so killing torchrun's
    process group alone would leave the trainers running. The trainers' workers get no signal:
    they must exit by themselves when their trainer dies."""
    try:
        job = psutil.Process(proc.pid)
        trainers = job.children()
        processes = [job, *job.children(recursive=True)]
    except psutil.NoSuchProcess:
        trainers, processes = [], []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun leads its own session (start_new_session)
    for trainer in trainers:
        with contextlib.suppress(psutil.NoSuchProcess):
            trainer.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    left = [p for p in processes if _running(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if _running(p)]
    assert not left, f"processes of the killed job still running: {[p.pid for p in left]}"


def _run_until_killed(
    launcher_args: list[str], script_args: list[str], log: Path, timeout: float = 180
) -> str:
    """Run a job with --stop-after N until it says it stopped, SIGKILL it; return its output."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            _command(launcher_args, script_args),
            cwd=ROOT,
            env=_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + timeout
        while "stopped after step" not in log.read_text():
            assert proc.poll() is None, f"the job ended before it stopped:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"the job did not stop:\n{log.read_text()}"
            time.sleep(0.2)
    finally:
        _kill_job(proc)
    return log.read_text()


def _run(launcher_args: list[str], script_args: list[str]) -> str:
    code, output = _finish(_launch(launcher_args, script_args))
    assert code == 0, output
    return output


def _kill_at_6_resume_on_3_workers(
    common: list[str], checkpoint: Path, tmp_path: Path
) -> tuple[str, dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
    """Run ``train_ddp.py`` with ``common`` on 2 ranks x 2 workers until step 6 and kill it,
    then resume its checkpoint on 1 rank x 3 workers. Returns the killed job's output, its
    checkpoint as it was then, its ranks' records and the resumed run's record."""
    output = _run_until_killed(
        ["--standalone", "--nproc_per_node=2"],
        [*common, "--workers", "2", "--out", str(tmp_path / "killed"), "--stop-after", "6"],
        tmp_path / "killed.log",
    )
    saved = torch.load(checkpoint)
    killed = _records(tmp_path / "killed", world=2)
    resume = ["--workers", "3", "--out", str(tmp_path / "resumed"), "--resume", str(checkpoint)]
    _run(["--standalone", "--nproc_per_node=1"], [*common, *resume])
    [resumed] = _records(tmp_path / "resumed", world=1)
    return output, saved, killed, resumed


def test_killed_job_resumes_on_one_rank_and_covers_the_epoch_once(
    ddp_data: Path, tmp_path: Path
) -> None:
    """2 ranks x 2 workers save at step 4, take steps 5 and 6 and are SIGKILLed; 1 rank x 3
    workers resumes: what the killed job saw up to its checkpoint plus what the resumed job saw
    of epoch 0 is the dataset exactly once (steps 5 and 6 are read again), and epoch 1 on the new
    layout covers it once too."""
    checkpoint = tmp_path / "checkpoint.pt"
    common = ["--data", str(ddp_data), "--batch-size", "4", "--epochs", "2"]
    common += ["--save-every", "4", "--checkpoint", str(checkpoint)]
    output, saved, killed, resumed = _kill_at_6_resume_on_3_workers(common, checkpoint, tmp_path)
    assert "step 4: saved" in output and "stopped after step 6" in output, output
    assert saved["step"] == 4
    # 7 steps per epoch and rank (25 samples each, batches of 4, shared 4 + 3 by its workers):
    # 2 batches per shard received
    assert saved["loader"]["epoch"] == 0
    assert saved["loader"]["received"] == [2, 2, 2, 2]
    assert [rec["step"] for rec in killed] == [4, 4]  # the records stop at the checkpoint
    assert resumed["resumed_from"] == 4
    assert [e["epoch"] for e in resumed["epochs"]] == [0, 1]
    rest, epoch1 = resumed["epochs"]
    # the 50 - 32 samples not yet received: 5 batches of 4, shared 2, 2, 1 by 3 workers
    assert rest["steps"] == rest["remaining"] == 5
    # the epoch's length: what each old rank received plus the rest (4 + 5), but never shorter
    # than this layout's epochs (13), which a trainer keeps as the length of the next ones
    assert rest["len"] == 13
    seen = [i for rec in killed for i in rec["epochs"][0]["ids"]] + rest["ids"]
    assert sorted(seen) == list(range(50)), "epoch 0 is not the dataset exactly once"
    assert sorted(epoch1["ids"]) == list(range(50))
    assert epoch1["steps"] == epoch1["len"] == 13  # 50 samples in 13 batches: 5, 4, 4


def _id_tars(images: Path, out: Path, per_shard: int) -> str:
    """The ImageFolder's images as shards of ``per_shard`` samples ``<k>.jpg`` and ``<k>.id``
    (``k``: the image's number in the folder's order), their pattern."""
    import io
    import tarfile

    from loader import list_images

    files, _labels = list_images(str(images))
    out.mkdir()
    shards = -(-len(files) // per_shard)
    for number in range(shards):
        with tarfile.open(out / f"train-{number:03d}.tar", "w") as tar:
            for k in range(number * per_shard, min(len(files), (number + 1) * per_shard)):
                for name, data in (
                    (f"{k:06d}.jpg", Path(files[k]).read_bytes()),
                    (f"{k:06d}.id", str(k).encode()),
                ):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return str(out / f"train-{{000..{shards - 1:03d}}}.tar")


def test_tar_shards_read_in_groups_resume_on_another_layout_exactly_once(
    ddp_data: Path, tmp_path: Path
) -> None:
    """The same kill and resume over 10 tar shards read 2 at a time (the remote order: each
    worker reads its own piece of a shard, in the layout the epoch started with): 2 ranks x 2
    workers save at step 4 and are killed at step 6; 1 rank x 3 workers finishes epoch 0 with
    what was not received, exactly once, then runs epoch 1 in its own layout."""
    urls = _id_tars(ddp_data, tmp_path / "tars", 5)
    checkpoint = tmp_path / "checkpoint.pt"
    common = ["--tars", urls, "--shuffle-window", "2", "--batch-size", "4", "--epochs", "2"]
    common += ["--save-every", "4", "--checkpoint", str(checkpoint)]
    output, saved, killed, resumed = _kill_at_6_resume_on_3_workers(common, checkpoint, tmp_path)
    assert "step 4: saved" in output and "stopped after step 6" in output, output
    assert saved["loader"]["sampling"]["fingerprint"].endswith("+window2")
    rest, epoch1 = resumed["epochs"]
    seen = [i for rec in killed for i in rec["epochs"][0]["ids"]] + rest["ids"]
    assert sorted(seen) == list(range(50)), "epoch 0 is not the dataset exactly once"
    assert sorted(epoch1["ids"]) == list(range(50))


def test_killed_job_resumes_on_the_same_layout_with_the_uninterrupted_stream(
    ddp_data: Path, tmp_path: Path
) -> None:
    """2 ranks x 2 workers with random crops and flips save at step 3 (workers 0 have delivered
    2 batches, workers 1 one), take steps 4 and 5 and are SIGKILLed; 2 ranks x 2 workers resume:
    per rank, the ids and the images' bytes seen up to the checkpoint followed by the resumed
    ones are the uninterrupted job's, epoch 1 included, and the final weights are the
    uninterrupted job's (the model, the optimizer's momentum, the order of the batches and the
    workers' random generators were all restored)."""
    two_ranks = ["--standalone", "--nproc_per_node=2"]
    common = ["--data", str(ddp_data), "--batch-size", "4", "--epochs", "2", "--workers", "2"]
    common += ["--save-every", "3", "--augment"]
    _run(
        two_ranks,
        [*common, "--checkpoint", str(tmp_path / "full.pt"), "--out", str(tmp_path / "full")],
    )
    full = _records(tmp_path / "full", world=2)

    checkpoint = tmp_path / "checkpoint.pt"
    common += ["--checkpoint", str(checkpoint)]
    output = _run_until_killed(
        two_ranks,
        [*common, "--out", str(tmp_path / "killed"), "--stop-after", "5"],
        tmp_path / "killed.log",
    )
    assert "step 3: saved" in output and "stopped after step 5" in output, output
    saved = torch.load(checkpoint)
    assert saved["step"] == 3
    assert saved["loader"]["epoch"] == 0
    assert saved["loader"]["received"] == [2, 1, 2, 1]
    killed = _records(tmp_path / "killed", world=2)

    _run(two_ranks, [*common, "--out", str(tmp_path / "resumed"), "--resume", str(checkpoint)])
    resumed = _records(tmp_path / "resumed", world=2)
    for rank in range(2):
        before, after, uninterrupted = killed[rank], resumed[rank], full[rank]
        assert before["step"] == 3 and after["resumed_from"] == 3
        assert [e["epoch"] for e in after["epochs"]] == [0, 1]
        rest, epoch1 = after["epochs"]
        assert rest["steps"] == rest["remaining"] == 7 - 3
        assert rest["len"] == 7  # the epoch's length, as for torch's DataLoader
        assert before["epochs"][0]["ids"] + rest["ids"] == uninterrupted["epochs"][0]["ids"], (
            f"rank {rank}: the resumed epoch 0 is not the uninterrupted stream"
        )
        digests = before["epochs"][0]["digests"] + rest["digests"]
        assert digests == uninterrupted["epochs"][0]["digests"], (
            f"rank {rank}: the images of the resumed epoch 0 are not the uninterrupted job's"
        )
        assert epoch1 == uninterrupted["epochs"][1], f"rank {rank}: epoch 1 differs"
        assert after["weights"] == uninterrupted["weights"], f"rank {rank}: other weights"


# ---------------------------------------------------------------------------- observability


def test_each_rank_writes_its_trace_and_every_rank_gets_the_same_advice(tmp_path: Path) -> None:
    """2 local ranks with trace=: one trace file per rank (.rank<k> before the extension), each
    with its own rank's trainer and worker tracks; diagnose() on every rank: the verdicts are
    each rank's, the advice for the settings every rank shares is the same on both and within
    the host's CPUs split between them."""
    from loader.config._env import OVERSUBSCRIBE, usable_cpus

    job = ROOT / "tests" / "integration" / "observability_job.py"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.Popen(
        [*launcher, str(job), str(tmp_path)],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    code, output = _finish(proc)
    assert code == 0, output
    assert not (tmp_path / "loader-trace.json").exists()
    reports = [json.loads((tmp_path / f"diagnosis{r}.json").read_text()) for r in (0, 1)]
    for rank, report in enumerate(reports):
        trace = json.loads((tmp_path / f"loader-trace.rank{rank}.json").read_text())
        events = trace["traceEvents"]
        [process] = [e for e in events if e["name"] == "process_name"]
        assert process["args"]["name"] == f"dali-capture-loader, rank {rank} of 2"
        assert process["pid"] == report["pid"]
        names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
        pids = report["worker_pids"]
        assert names == {
            0: "trainer",
            **{w + 1: f"worker {w} (shard {2 * rank + w}/4, pid {pids[w]})" for w in (0, 1)},
            3: "worker server",  # (what it did for the loader: its start's spans)
        }
        spans = {(e["tid"], e["name"]) for e in events if e["ph"] == "X"}
        assert {(0, "next"), (1, "load"), (1, "dali"), (2, "load"), (2, "dali")} <= spans

        assert report["rank"] == rank and report["world_size"] == 2
        assert report["local_ranks"] == 2  # torchrun's LOCAL_WORLD_SIZE
        assert report["cpus"] == max(1, usable_cpus() // 2) == max(1, report["node_cpus"] // 2)
        assert f"rank {rank} (this rank): {report['verdict']}" in report["text"]
    first, second = reports
    # the same advice, the same reason and every rank's verdict, on both ranks
    assert first["job"] == second["job"]
    assert first["reason"] == second["reason"] and first["budget"] == second["budget"]
    assert first["ranks"] == second["ranks"] == [first["verdict"], second["verdict"]]
    shared = [line for line in first["text"].splitlines() if line.startswith("  every rank:")]
    assert len(shared) == 1 and shared[0] in second["text"].splitlines()
    workers = first["job"].get("num_workers")
    assert first["budget"] <= OVERSUBSCRIBE * first["cpus"]
    if workers is not None:  # within the host's CPUs: its share for each of the 2 ranks
        assert workers <= first["budget"]
        assert all(f"num_workers={workers}" in r["suggestion"] for r in reports)
    for report in reports:
        named = {int(n) for n in re.findall(r"num_workers=(\d+)", report["text"])}
        assert named <= ({workers} if workers is not None else set()), report["text"]


def test_a_rank_that_dies_is_restarted_by_torchrun_and_resumes_exactly_once(
    ddp_data: Path, tmp_path: Path
) -> None:
    """``torchrun --max-restarts 1``: the last rank crashes mid-epoch after a checkpoint, torchrun
    stops the other and restarts both, ``--resume auto`` goes on from the checkpoint; over the
    two attempts every epoch is delivered exactly once (what the first attempt saw up to its
    checkpoint, then the restarted attempt)."""
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint.pt"
    env = {**_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    script = ["--data", str(ddp_data), "--out", str(out), "--batch-size", "4", "--workers", "1"]
    script += ["--save-every", "3", "--checkpoint", str(checkpoint), "--resume", "auto"]
    launcher = ["--standalone", "--nproc_per_node=2", "--max-restarts", "1"]
    proc = subprocess.Popen(
        _command(launcher, [*script, "--die-at", "5"]),
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    code, output = _finish(proc, timeout=300)
    assert code == 0, output[-4000:]
    assert "rank 1 dies at step 5" in output
    first = _records(out, 2)  # as of the checkpoint at step 3
    again = [json.loads((out / f"rank{r}.restart1.json").read_text()) for r in range(2)]
    assert {rec["step"] for rec in first} == {3}
    assert {rec["resumed_from"] for rec in again} == {3} and {rec["attempt"] for rec in again} == {
        1
    }
    steps = first[0]["epochs"][0]["len"]  # 50 images, 2 ranks, batches of 4: 7 per epoch
    for epoch in range(2):
        ids = [
            i
            for rec in [*first, *again]
            for part in rec["epochs"]
            if part["epoch"] == epoch
            for i in part["ids"]
        ]
        assert sorted(ids) == list(range(50)), f"epoch {epoch} not exactly once"
    assert again[0]["step"] == 2 * steps
