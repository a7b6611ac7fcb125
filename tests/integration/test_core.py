"""The loader core with real spawned workers running real DALI capture loops."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import psutil
import pytest

from loader import (
    AgreementError,
    LoadedBatch,
    LoadedTuple,
    Loader,
    LoaderClosedError,
    SlotsExhaustedError,
    WorkerDiedError,
    WorkerError,
)
from tests import pipelines as P
from tests.pipelines import ids_of, reader

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(120)


START_METHODS = pytest.mark.parametrize("start_method", ["spawn", "forkserver"])


@START_METHODS
def test_one_epoch_covers_every_file_exactly_once_and_replays(
    image_root: Path, start_method: str
) -> None:
    with Loader(
        reader(image_root),
        P.decode_step,
        batch_size=4,
        num_workers=2,
        start_method=start_method,
    ) as loader:
        for _epoch in range(3):
            seen: list[int] = []
            for batch in loader:
                assert isinstance(batch, LoadedBatch)
                assert batch["image"].shape == (4, 3, 16, 16)
                assert batch["image"].dtype == np.float32
                assert batch["id"].shape == (4, 1)
                seen += ids_of(batch)
                del batch
            assert sorted(seen) == list(range(48))
        stats = loader.stats()
    # one trace per worker for three epochs: epochs 1 and 2 replayed the traced pipeline
    assert [w.traces for w in stats.workers] == [1, 1]
    assert all(w.steps == 18 for w in stats.workers)
    assert stats.batches == 36


def test_round_robin_order_is_deterministic(image_root: Path) -> None:
    runs = []
    for _ in range(2):
        source = reader(image_root, shuffle=True)
        with Loader(source, P.decode_step, batch_size=4, num_workers=2, seed=7) as loader:
            sequence = []
            for batch in loader:
                sequence.append((batch.info.worker, ids_of(batch), batch["image"].sum()))
                del batch
        runs.append(sequence)
    assert runs[0] == runs[1]
    assert [w for w, _, _ in runs[0]] == [0, 1] * 6
    with Loader(reader(image_root, shuffle=True), P.decode_step, batch_size=4, seed=8) as other:
        different = [ids_of(b) for b in other]
    assert different != [ids for _, ids, _ in runs[0]]


def test_ragged_outputs_are_lists_of_samples(image_root: Path) -> None:
    files = sorted(image_root.glob("*/*.jpg"))
    assert len(files) == 48
    seen: list[int] = []
    batches = 0
    with Loader(reader(image_root), P.raw_step, batch_size=4, num_workers=2) as loader:
        for batch in loader:
            jpegs = batch["jpeg"]
            assert isinstance(jpegs, list) and len(jpegs) == 4
            for sample_id, data in zip(ids_of(batch), jpegs, strict=True):
                assert data.tobytes() == files[sample_id].read_bytes()
                seen.append(sample_id)
            assert batch["shape"].shape == (4, 3)
            batches += 1
            del batch, jpegs
    # the loop saw the whole epoch: 12 batches of 4, every file once
    assert batches == 12
    assert sorted(seen) == list(range(48))


def test_tuple_step_gives_tuples(image_root: Path) -> None:
    with Loader(reader(image_root), P.tuple_step, batch_size=4, num_workers=1) as loader:
        batch = next(iter(loader))
        assert isinstance(batch, LoadedTuple)
        images, ids = batch
        assert images.shape == (4, 8, 8, 3)
        assert ids.shape == (4, 1)


def test_views_return_slots_when_collected(image_root: Path) -> None:
    with Loader(
        reader(image_root), P.decode_step, batch_size=4, num_workers=1, prefetch=1
    ) as loader:
        count = 0
        for batch in loader:
            count += 1
            del batch
        assert count == 12
        assert loader.stats().slots_in_use <= loader.config.num_slots


def test_holding_every_slot_is_an_error_not_a_hang(image_root: Path) -> None:
    loader = Loader(reader(image_root), P.decode_step, batch_size=4, num_workers=1, prefetch=1)
    held = []
    with pytest.raises(SlotsExhaustedError, match="copy=True"):
        for batch in loader:
            held.append(batch)
    assert len(held) == loader.config.num_slots
    del held, batch
    loader.close()


def test_copy_true_releases_at_once(image_root: Path) -> None:
    with Loader(
        reader(image_root), P.decode_step, batch_size=4, num_workers=1, prefetch=1, copy=True
    ) as loader:
        held = list(loader)
        assert len(held) == 12
        assert sorted(i for b in held for i in ids_of(b)) == list(range(48))
        assert loader.stats().slots_in_use == 0


def test_torch_output_is_zero_copy_tensors(image_root: Path) -> None:
    torch = pytest.importorskip("torch")
    with Loader(reader(image_root), P.decode_step, batch_size=4, output="torch") as loader:
        batch = next(iter(loader))
        assert isinstance(batch["image"], torch.Tensor)
        assert batch["image"].shape == (4, 3, 16, 16)
        assert batch["image"].dtype == torch.float32
        del batch


def test_external_source_root_and_eager_mode() -> None:
    for capture in (True, False):
        with Loader(P.id_source, P.cast_step, batch_size=4, capture=capture) as loader:
            for _ in range(2):
                seen = sorted(i for b in loader for i in ids_of(b))
                assert seen == list(range(64))
            traces = [w.traces for w in loader.stats().workers]
        assert traces == ([1, 1] if capture else [0, 0])


def test_feeders_are_passed_as_keywords() -> None:
    with Loader(
        P.id_source, P.feeder_step, feeders=P.offset_feeders, batch_size=4, copy=True
    ) as loader:
        batches = list(loader)
    offsets = {b.info.worker: [] for b in batches}
    for b in batches:
        offsets[b.info.worker].append(int(b["offset"][0, 0]))
    assert offsets[0] == list(range(8))
    assert offsets[1] == [1000 + i for i in range(8)]


def test_nothing_captured_warns_once_naming_workers() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Loader(P.id_source, P.passthrough_step, batch_size=4) as loader:
            for _ in range(2):
                assert sorted(i for b in loader for i in ids_of(b)) == list(range(64))
    messages = [str(w.message) for w in caught if "no operators were captured" in str(w.message)]
    assert len(messages) == 1
    assert "worker(s) 0 (shard 0/2), 1 (shard 1/2)" in messages[0]


def test_signature_mismatch_names_worker_and_field() -> None:
    loader = Loader(P.dtype_by_shard_source, P.copy_step, batch_size=2)
    with pytest.raises(AgreementError, match=r"worker 1 \(shard 1/2.*on outputs") as info:
        list(loader)
    assert isinstance(info.value, RuntimeError)
    assert loader.closed
    with pytest.raises(LoaderClosedError):
        iter(loader)


@START_METHODS
def test_step_exception_keeps_type_and_says_where(start_method: str) -> None:
    with Loader(P.id_source, P.failing_step, batch_size=4, start_method=start_method) as loader:
        with pytest.raises(ValueError, match="step failed on purpose") as info:
            list(loader)
    message = str(info.value)
    assert "shard " in message and "epoch 0" in message and "step 2" in message
    assert "failing_step" in info.value.remote_traceback  # type: ignore[attr-defined]


def test_user_exception_keeps_its_class_when_the_trainer_knows_it() -> None:
    with Loader(P.id_source, P.custom_error_step, batch_size=4) as loader:
        with pytest.raises(P.CustomError, match="custom failure") as info:
            list(loader)
    assert info.value.worker in (0, 1) and info.value.phase == "step"  # type: ignore[attr-defined]


def test_exception_that_cannot_be_rebuilt_becomes_worker_error() -> None:
    with Loader(P.id_source, P.needs_args_step, batch_size=4) as loader:
        with pytest.raises(WorkerError, match=r"NeedsArgs: .*cannot be re-created") as info:
            list(loader)
    assert info.value.remote_type == "tests.pipelines.NeedsArgs"


MAIN_SCRIPT = """
import sys
import nvidia.dali.experimental.dynamic as ndd
from loader import Loader
from tests import pipelines as P

class BadSample(Exception):
    pass

def bad_step(ids):
    raise BadSample("sample 3 is corrupt")

if __name__ == "__main__":
    with Loader(P.id_source, bad_step, batch_size=4, num_workers=1) as loader:
        try:
            list(loader)
        except BadSample as error:
            print("caught", type(error).__module__, error.phase)
"""


def test_exception_class_of_the_main_script_can_be_caught(tmp_path: Path) -> None:
    script = tmp_path / "main_script.py"
    script.write_text(MAIN_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=90, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "caught __main__ step" in done.stdout


def test_bad_step_output_is_a_type_error() -> None:
    with Loader(P.id_source, P.bad_output_step, batch_size=4) as loader:
        with pytest.raises(TypeError, match="not a DALI Batch"):
            list(loader)


def test_source_exception_raises_at_construction() -> None:
    with pytest.raises(FileNotFoundError, match=r"no data for shard .*before the first epoch"):
        Loader(P.failing_source, P.cast_step, batch_size=4)
    with pytest.raises(TypeError, match="DALI reader"):
        Loader(P.not_a_source, P.cast_step, batch_size=4)


def test_killed_worker_is_reported_at_once() -> None:
    with Loader(P.id_source, P.cast_step, batch_size=4, num_workers=2, copy=True) as loader:
        batches = iter(loader)
        next(batches)
        victim = loader.worker_pids()[1]
        os.kill(victim, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(WorkerDiedError, match=f"pid {victim}.* SIGKILL") as info:
            for _ in batches:
                pass
        assert time.monotonic() - started <= 2  # sentinels wake the trainer, no timeout involved
    assert info.value.signal_name == "SIGKILL" and info.value.worker == 1


def test_killing_step_and_exit_code_are_reported() -> None:
    with Loader(P.id_source, P.killing_step, batch_size=4, num_workers=2) as loader:
        with pytest.raises(WorkerDiedError, match="SIGKILL"):
            list(loader)
    with Loader(P.id_source, P.exiting_step, batch_size=4, num_workers=1) as loader:
        with pytest.raises(WorkerDiedError, match="exited with code 3") as info:
            list(loader)
    assert info.value.exitcode == 3


def test_fork_is_refused_and_forkserver_works() -> None:
    with pytest.raises(ValueError, match="fork"):
        Loader(P.id_source, P.cast_step, batch_size=4, start_method="fork")
    with Loader(P.id_source, P.cast_step, batch_size=4, start_method="forkserver") as loader:
        assert sorted(i for b in loader for i in ids_of(b)) == list(range(64))


def test_close_is_idempotent_and_leaves_nothing() -> None:
    loader = Loader(P.id_source, P.cast_step, batch_size=4)
    pids = loader.worker_pids()
    next(iter(loader))
    loader.close()
    loader.close()
    assert not any(
        psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in pids
    )
    with pytest.raises(LoaderClosedError):
        iter(loader)


def test_dropping_the_loader_stops_its_workers() -> None:
    loader = Loader(P.id_source, P.cast_step, batch_size=4)
    pids = loader.worker_pids()
    batch = next(iter(loader))
    del loader, batch
    gc.collect()
    _gone, alive = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], 5)
    assert not alive


def test_breaking_out_starts_a_complete_next_epoch(image_root: Path) -> None:
    with Loader(reader(image_root), P.decode_step, batch_size=4, num_workers=2) as loader:
        for i, batch in enumerate(loader):
            assert batch.info.epoch == 0
            if i == 2:
                break
        del batch
        seen = sorted(i for b in loader for i in ids_of(b))
        assert seen == list(range(48))
        assert [w.rebuilds for w in loader.stats().workers] == [1, 1]


def test_bad_arguments_fail_before_workers_start() -> None:
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="batch_size"):
            Loader(P.id_source, P.cast_step, batch_size=bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="lambda"):
        Loader(P.id_source, lambda ids: ids, batch_size=4)
    with pytest.raises(ValueError, match="output"):
        Loader(P.id_source, P.cast_step, batch_size=4, output="jax")
    for flag in ("copy", "capture", "in_order"):  # a string is not a flag: "no" is not False
        with pytest.raises(TypeError, match=f"{flag} must be True or False, got 'no'"):
            Loader(P.id_source, P.cast_step, batch_size=4, **{flag: "no"})


def test_breaking_out_in_eager_mode_starts_a_complete_next_epoch() -> None:
    with Loader(P.id_source, P.cast_step, batch_size=4, capture=False, copy=True) as loader:
        for i, batch in enumerate(loader):
            assert batch.info.epoch == 0
            if i == 1:
                break
        assert sorted(i for b in loader for i in ids_of(b)) == list(range(64))
        assert [w.traces for w in loader.stats().workers] == [0, 0]


def test_padded_rows_of_a_padding_reader_are_flagged(image_root: Path) -> None:
    """48 files, 2 shards of 24, batches of 5: each shard's last batch has 1 padded row."""
    source = reader(image_root, batch_size=5, pad=True)
    with Loader(source, P.decode_step, batch_size=5, copy=True) as loader:
        assert len(loader) == 10
        for _ in range(2):
            real = []
            for batch in loader:
                ids = ids_of(batch)
                real += ids[: len(ids) - batch.info.padded]
            assert sorted(real) == list(range(48))
