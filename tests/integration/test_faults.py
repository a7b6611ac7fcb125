"""The fault matrix: every failure reaches the trainer quickly, clearly, and leaks nothing."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from loader import Loader, WorkerDiedError, WorkerTimeoutError
from tests import pipelines as P

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


def _started_loader(step: object, **kwargs: object) -> Loader:
    return Loader(P.id_source, step, batch_size=4, num_workers=2, **kwargs)  # type: ignore[arg-type]


def test_segfault_is_reported_with_signal_and_stack() -> None:
    with _started_loader(P.segfault_step) as loader:
        batches = iter(loader)
        next(batches)  # the crash comes after this: worker 0 needs a slot back to reach it
        started = time.monotonic()
        with pytest.raises(WorkerDiedError, match="SIGSEGV") as info:
            for _ in batches:
                pass
        assert time.monotonic() - started <= 2  # the matrix's bound
    assert "segfault_step" in str(info.value)  # faulthandler's stack of the crashed worker


def test_stuck_worker_times_out_with_its_stack() -> None:
    with _started_loader(P.stuck_step, timeout=2) as loader:
        batches = iter(loader)
        next(batches), next(batches)  # both traced; each worker's second step never returns
        started = time.monotonic()
        with pytest.raises(WorkerTimeoutError, match="timeout") as info:
            next(batches)
        elapsed = time.monotonic() - started
    assert elapsed <= 2 + 2  # timeout + 2 s, the matrix's bound
    assert "stuck_step" in info.value.stack
    assert info.value.worker == 0


def test_feeder_callback_exception_keeps_its_type() -> None:
    with _started_loader(P.feeder_step, feeders=P.failing_feeders) as loader:
        with pytest.raises(KeyError, match="feeder callback failed"):
            list(loader)


def test_corrupt_jpeg_raises_dalis_error_with_context(tmp_path: Path, image_root: Path) -> None:
    """DALI 2.4 names the failing operator but not the file inside a captured pipeline."""
    folder = tmp_path / "broken" / "class_00"
    folder.mkdir(parents=True)
    good = sorted(image_root.glob("*/*.jpg"))[:3]
    for path in good:
        (folder / path.name).write_bytes(path.read_bytes())
    (folder / "zz_truncated.jpg").write_bytes(good[0].read_bytes()[:200])
    source = functools.partial(P.file_root_reader, root=str(tmp_path / "broken"))
    with Loader(source, P.decode_only_step, batch_size=2, num_workers=1) as loader:
        with pytest.raises(
            RuntimeError, match=r"decoders.Image[\s\S]*worker 0, shard 0/1, epoch 0"
        ):
            list(loader)


def test_missing_file_root_fails_at_start(tmp_path: Path) -> None:
    source = functools.partial(P.file_root_reader, root=str(tmp_path / "nope"))
    with pytest.raises(RuntimeError, match="before the first epoch"):
        Loader(source, P.decode_only_step, batch_size=2, num_workers=1)


def _trainer(*args: str) -> tuple[subprocess.Popen[str], list[int]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.trainer_script", *args],
        cwd=ROOT,
        env=env,
        # (SIGINT as a terminal gives it: a suite started in the background by a shell without
        # job control inherits SIGINT ignored, and Python keeps an ignored SIGINT ignored)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2, proc.stderr.read() if proc.stderr else ""
    return proc, pids


def test_killed_trainer_takes_its_workers_along() -> None:
    proc, pids = _trainer()
    proc.kill()
    proc.wait(10)
    workers = [psutil.Process(p) for p in pids if psutil.pid_exists(p)]
    _gone, alive = psutil.wait_procs(workers, timeout=3)  # the matrix's bound
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    proc.stderr.close()


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_trainer_shuts_down_cleanly(how: signal.Signals) -> None:
    proc, pids = _trainer("ready")
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().strip() == "iterating"
    proc.send_signal(how)
    proc.wait(10)
    workers = [psutil.Process(p) for p in pids if psutil.pid_exists(p)]
    _gone, alive = psutil.wait_procs(workers, timeout=3)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    stderr = proc.stderr.read()
    proc.stdout.close()
    proc.stderr.close()
    if how == signal.SIGINT:  # KeyboardInterrupt through the loader's close; Python then ends
        # itself by SIGINT, as an uncaught KeyboardInterrupt does
        assert proc.returncode == -signal.SIGINT, stderr
        assert stderr.rstrip().endswith("KeyboardInterrupt"), stderr
    else:  # SIGTERM's default action: the trainer ends at once; its workers follow it
        assert proc.returncode == -signal.SIGTERM, stderr
    # nothing from the workers: no traceback, no faulthandler dump, no multiprocessing report
    assert "dali-loader-worker" not in stderr and "/workers/" not in stderr, stderr


def test_next_loader_works_after_a_failure() -> None:
    with _started_loader(P.killing_step) as loader:
        with pytest.raises(WorkerDiedError):
            list(loader)
    with _started_loader(P.cast_step, copy=True) as loader:
        assert len(list(loader)) == 16


def test_more_shards_than_files_fails_at_start(tmp_path: Path, image_root: Path) -> None:
    folder = tmp_path / "one" / "class_00"
    folder.mkdir(parents=True)
    first = sorted(image_root.glob("*/*.jpg"))[0]
    (folder / first.name).write_bytes(first.read_bytes())
    source = functools.partial(P.file_root_reader, root=str(tmp_path / "one"))
    with pytest.raises(RuntimeError, match=r"number of shards[\s\S]*before the first epoch"):
        Loader(source, P.decode_only_step, batch_size=2, num_workers=2)


def test_too_little_shared_memory_names_the_size_needed() -> None:
    from loader import SharedMemoryError

    with Loader(P.big_source, P.copy_step, batch_size=4, num_workers=1, shm_limit=2**20) as loader:
        with pytest.raises(SharedMemoryError, match=r"needs \d+ bytes .*shm_limit") as info:
            next(iter(loader))
    assert "step 0" in str(info.value)
    assert isinstance(info.value, MemoryError)


def test_close_of_eight_workers_is_quick() -> None:
    loader = Loader(P.id_source, P.cast_step, batch_size=4, num_workers=8, num_threads=1)
    next(iter(loader))
    started = time.monotonic()
    loader.close()
    assert time.monotonic() - started < 5  # measured in bench/soak.py; ~tens of ms


def test_empty_dataset_fails_at_start(tmp_path: Path) -> None:
    (tmp_path / "empty" / "class_00").mkdir(parents=True)
    source = functools.partial(P.file_root_reader, root=str(tmp_path / "empty"))
    with pytest.raises(RuntimeError, match="before the first epoch"):
        Loader(source, P.decode_only_step, batch_size=2, num_workers=1)
