"""What a new user hit, each pinned by a test that fails without its fix."""

from __future__ import annotations

import functools
import time
from pathlib import Path

import numpy as np
import pytest

from loader import (
    LoadedArray,
    Loader,
    LoaderError,
    SharedMemoryError,
    WorkerTimeoutError,
)
from loader.sample import list_images, write_sample_dataset
from tests import pipelines as P
from tests.pipelines import ids_of

pytestmark = pytest.mark.timeout(150)


@pytest.mark.parametrize(
    ("files", "ranks", "workers"), [(13, 1, 3), (13, 2, 2), (14, 1, 4), (12, 2, 1), (200, 1, 3)]
)
def test_reader_that_pads_its_shard_delivers_every_file_once(
    tmp_path: Path, files: int, ranks: int, workers: int
) -> None:
    """stick_to_shard + pad_last_batch: shorter shards' repeats are flagged, never counted."""
    root = write_sample_dataset(tmp_path / "images", count=files, classes=2, seed=3)
    batch_size = 8 if files > 100 else 2
    real: list[int] = []
    steps: set[int] = set()
    for rank in range(ranks):
        source = P.reader(root, batch_size=batch_size, pad=True)
        with Loader(
            source,
            P.raw_step,
            batch_size=batch_size,
            num_workers=workers,
            rank=rank,
            world_size=ranks,
            copy=True,
        ) as loader:
            batches = list(loader)
            assert len(batches) == len(loader)
            steps.add(len(batches))
            for batch in batches:
                ids = ids_of(batch)
                kept = ids[: len(ids) - batch.info.padded]
                assert set(ids[len(kept) :]) <= {kept[-1] if kept else ids[0]}  # repeats
                real += kept
    assert len(steps) == 1  # every rank takes the same number of steps
    assert sorted(real) == list(range(files))


@pytest.mark.parametrize("stuck_at", [1, 2])
def test_timeout_covers_a_workers_second_and_third_batch(stuck_at: int) -> None:
    step = functools.partial(P.stuck_at_step, at=stuck_at)
    with Loader(P.id_source, step, batch_size=4, num_workers=2, timeout=3) as loader:
        batches = iter(loader)
        for _ in range(2 * stuck_at):  # steps before the stuck one, of both workers
            next(batches)
        started = time.monotonic()
        with pytest.raises(WorkerTimeoutError) as info:
            next(batches)
        elapsed = time.monotonic() - started
    assert elapsed <= 3 + 2.5
    assert info.value.worker == 0 and info.value.step == stuck_at
    assert f"step {stuck_at}]" in str(info.value)
    assert "stuck_at_step" in info.value.stack


def test_a_replaced_epoch_iterator_says_so() -> None:
    with Loader(P.id_source, P.cast_step, batch_size=4, num_workers=1, copy=True) as loader:
        first = iter(loader)
        next(first)
        second = iter(loader)
        with pytest.raises(RuntimeError, match="replaced by a newer iter"):
            next(first)
        assert len(list(second)) == 16


def test_stats_count_samples_over_iteration_time_apart_from_startup() -> None:
    with Loader(P.sample_source, P.cast_step, batch_size=4, num_workers=2, copy=True) as loader:
        time.sleep(0.5)  # idle before iterating: neither startup nor iteration
        for _ in range(2):
            for batch in loader:
                del batch
        stats = loader.stats()
    assert stats.batches == 16 and stats.samples == 60  # 2 epochs of 30; padded rows left out
    assert stats.startup_seconds > 0
    assert stats.samples_per_second == pytest.approx(stats.samples / stats.iteration_seconds)
    assert stats.batches_per_second == pytest.approx(stats.batches / stats.iteration_seconds)
    assert stats.samples_per_second < 4 * stats.batches_per_second  # padding is not a sample


def test_single_output_step_carries_info() -> None:
    with Loader(P.sample_source, P.single_step, batch_size=4, num_workers=2) as loader:
        padded = 0
        for batch in loader:
            assert isinstance(batch, LoadedArray) and batch.shape == (4, 1)
            assert batch.info.epoch == 0 and batch.info.worker in (0, 1)
            padded += batch.info.padded
            del batch
    assert padded == 2  # 30 samples in 2 shards of 4-sample batches: 32 rows


def test_shared_memory_error_is_a_loader_error() -> None:
    assert issubclass(SharedMemoryError, LoaderError) and issubclass(SharedMemoryError, MemoryError)


@pytest.mark.parametrize("value", [0, -5, float("nan"), float("inf")])
def test_startup_timeout_is_validated_before_any_worker_starts(value: float) -> None:
    with pytest.raises(ValueError, match="startup_timeout must be a positive number"):
        Loader(P.id_source, P.cast_step, batch_size=4, startup_timeout=value)


def test_reader_built_for_another_batch_size_fails_at_start(image_root: Path) -> None:
    source = P.reader(image_root, batch_size=8)
    with pytest.raises(ValueError, match="max_batch_size=8 but the Loader's batch_size is 4"):
        Loader(source, P.raw_step, batch_size=4, num_workers=1)


def test_an_error_in_load_names_the_load_phase_and_the_sample() -> None:
    with Loader(P.failing_load_source, P.cast_step, batch_size=4, num_workers=1) as loader:
        with pytest.raises(ValueError, match=r"sample 7 cannot be read \[.*in load, sample 7\]"):
            list(loader)


def test_out_of_order_delivery_takes_whichever_batch_is_ready() -> None:
    with Loader(
        P.slow_start_source, P.cast_step, batch_size=4, num_workers=2, in_order=False, copy=True
    ) as loader:
        batches = iter(loader)
        first = next(batches)
        assert first.info.worker == 1  # worker 0 is still loading its first batch
        ids = ids_of(first) + [i for b in batches for i in ids_of(b)]
        assert sorted(ids) == list(range(64))  # exactly once
        # positions stay per shard: a state taken mid-epoch resumes exactly once
        batches = iter(loader)
        seen = [i for _ in range(5) for i in ids_of(next(batches))]
        state = loader.state_dict()
    with Loader(
        P.slow_start_source, P.cast_step, batch_size=4, num_workers=2, in_order=False, copy=True
    ) as loader:
        loader.load_state_dict(state)
        rest = [i for b in loader for i in ids_of(b)]
    assert sorted(seen + rest) == list(range(64))


FORKSERVER_SCRIPT = """
import time
import psutil
from loader import Loader
from loader.processes.server import server_pid
from tests import pipelines as P

def ids(loader):
    return sorted(int(v) for b in loader for v in b["id"].ravel())

if __name__ == "__main__":
    with Loader(P.id_source, P.cast_step, batch_size=4, start_method="forkserver") as loader:
        assert ids(loader) == list(range(64))
    server = psutil.Process(server_pid())
    mapped = any("dali" in m.path for m in server.memory_maps())
    started = time.monotonic()
    with Loader(P.id_source, P.cast_step, batch_size=4, start_method="forkserver") as loader:
        ready = time.monotonic() - started
        assert ids(loader) == list(range(64))
    print("server-imported-dali", mapped, "second-start", round(ready, 2))
"""


def test_forkserver_preloads_dali_and_its_workers_run_it_safely(tmp_path: Path) -> None:
    """The forkserver imports DALI once (never runs it) and forks workers that run it: their
    epochs are right, and a second loader starts without importing DALI again."""
    import os
    import subprocess
    import sys

    script = tmp_path / "two_loaders.py"
    script.write_text(FORKSERVER_SCRIPT)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    words = done.stdout.split()
    assert words[:2] == ["server-imported-dali", "True"], done.stdout  # (speed: bench.startup)


NO_MAIN_GUARD_SCRIPT = """
import numpy as np
{imports}
from loader import Loader
from tests import pipelines as P
{work}
loader = Loader(P.sample_source, P.cast_step, batch_size=4, num_workers=2, startup_timeout=120)
print(sum(1 for _ in loader))
"""

#: A model built at the top of the script before its Loader: torch's matrix products start an
#: OpenMP pool in the process that runs them (here the worker server, as it imports the script
#: for its workers); a fork of that process that ran them again waited for the pool's threads for
#: ever (the workers stuck until the 300 s start timeout, then left behind by a killed trainer).
TORCH_WORK = (
    "import torch",
    "weights = torch.randn(512, 512)\n"
    "for _ in range(5):\n"
    "    weights = torch.tanh(weights @ weights)",
)


@pytest.mark.parametrize("imports, work", [("", ""), TORCH_WORK], ids=["plain", "torch-work"])
def test_a_script_without_a_main_guard_is_told_to_add_one(
    tmp_path: Path, imports: str, work: str
) -> None:
    """A Loader made at a script's top level runs again in every spawned worker (each imports
    the main module): the worker says why it stops and the trainer's error says what to do, in
    seconds, also when the script's top level ran torch's matrix products before the Loader."""
    import os
    import subprocess
    import sys

    import psutil

    script = tmp_path / "no_guard.py"
    script.write_text(NO_MAIN_GUARD_SCRIPT.format(imports=imports, work=work))
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    process = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    watched = psutil.Process(process.pid)
    children: dict[int, str] = {}
    while process.poll() is None:  # note every process it starts, to check none is left
        try:
            for child in watched.children(recursive=True):
                children.setdefault(child.pid, " ".join(child.cmdline()))
        except psutil.Error:
            pass
        time.sleep(0.05)
    _out, err = process.communicate(timeout=60)
    assert process.returncode == 1
    assert "WorkerDiedError" in err, err[-2000:]
    trainer_error = err[err.rindex("WorkerDiedError") :]
    assert 'if __name__ == "__main__":' in trainer_error
    assert "its Python traceback is on its stderr" in trainer_error
    # the worker's own traceback names the cause (not only multiprocessing's generic text)
    assert "was called while a new process (a loader worker) was importing" in err
    deadline = time.monotonic() + 10
    while (left := [c for pid, c in children.items() if psutil.pid_exists(pid)]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.1)
    assert not left


def test_a_corrupt_file_is_named_first_with_the_skip_option(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Issue 31: a failing decode raised ~20 lines of DALI's text (a traceback of DALI's own
    graph code) with the file named only at its end, never said that on_error="skip" exists,
    and the worker printed the decoder's own log line twice (once more while it searched the
    batch for the file). Spawned, so that the worker's stderr is this test's."""
    root = write_sample_dataset(tmp_path / "images", count=16, classes=2, seed=3)
    files, _labels = list_images(root)
    bad = files[9]
    Path(bad).write_bytes(Path(bad).read_bytes()[:200])  # a truncated JPEG
    source = functools.partial(P.files_with_ids_source, root=str(root), batch_size=4)
    with Loader(
        source, P.decode_files_step, batch_size=4, num_workers=1, start_method="spawn"
    ) as loader:
        with pytest.raises(RuntimeError) as info:
            list(loader)
    message = str(info.value)
    first = message.splitlines()[0]
    assert first.startswith(f"failing sample 9 ({bad}): CPU operator decoders.Image failed: ")
    assert "[worker 0, shard 0/1, epoch 0, step " in first
    assert 'Hint: on_error="skip" leaves samples that fail out' in first
    assert len(message.splitlines()) == 1 and len(message) < 600
    # DALI's whole text is kept, in the worker's traceback
    remote = getattr(info.value, "remote_traceback", "")
    assert "nvImageCodec failure" in remote and "nvImageCodec failure" in first
    # the decoder's own line, printed by the failed batch, is not printed again by the search
    # for the file; it is in the message instead
    assert capfd.readouterr().err.count("Invalid marker") == 1
    assert "(printed: [jpeg_parser] Invalid marker)" in first


@pytest.mark.parametrize("batch_size", [4, 8])
def test_one_step_with_per_sample_random_flips_runs_under_any_batch_size(
    image_root: Path, batch_size: int
) -> None:
    """Issue 31: ``coin_flip(batch_size=images.batch_size)`` takes the batch size from the
    batch it flips, so one step function serves any Loader batch size; each sample is flipped
    on its own (``coin_flip()`` without a batch size draws one flip for the whole batch)."""
    source = functools.partial(P.files_with_ids_source, root=str(image_root), batch_size=batch_size)
    flips: list[list[int]] = []
    with Loader(
        source, P.flip_files_step, batch_size=batch_size, num_workers=2, copy=True
    ) as loader:
        for batch in loader:
            images = np.asarray(batch["image"])
            flipped = np.asarray(batch["flipped"])
            flip = [int(v) for v in np.asarray(batch["flip"]).ravel()]
            assert images.shape == (batch_size, 8, 8, 3) and len(flip) == batch_size
            for image, out, mirrored in zip(images, flipped, flip, strict=True):
                np.testing.assert_array_equal(out, image[:, ::-1] if mirrored else image)
            flips.append(flip)
    assert any(len(set(flip)) == 2 for flip in flips)  # flips differ within a batch
