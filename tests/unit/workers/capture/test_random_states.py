"""Random generator states: how a batch and a state carry them, how a worker restores them
(DALI in this process, eager, no workers), and the dataset fingerprint of a state."""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ipc import place_outputs, wire
from loader.run._checkpoint import make_state, parse_state
from workers import dali
from workers.capture._random import RandomGenerators
from workers.sources.files._files import ListedFiles
from workers.sources.files._folder_index import open_folder
from workers.sources.storage import CACHE_DIR_ENV

SAMPLING = wire.Sampling(30, 4, 0, True, False, "v1")
STATE_A = "Philox_0000000000000007_0000000000000000:0000000000000005_1"
STATE_B = "Philox_0000000000000063_0000000000000000:0000000000000003_2"


# --------------------------------------------------------------------------- the wire
def test_a_batch_carries_its_random_states_in_the_binary_frame() -> None:
    outputs, nbytes = place_outputs([("id", "<i8", 8, [(1,)] * 4, "")])
    random = wire.join_states([STATE_A, STATE_B])
    record = wire.BatchReady(1, 2, 0, 1, 3, outputs, nbytes, 0, 5, 6, random=random)
    codec = wire.BatchCodec()
    frame = codec.encode(record)
    assert wire.FRAME.unpack_from(frame)[1] == wire.FRAME_BATCH
    assert codec.decode(wire.FRAME_BATCH, frame, wire.FRAME.size, len(frame)) == record
    # a batch whose step drew nothing costs no byte more than before
    plain = wire.BatchReady(1, 2, 0, 1, 3, outputs, nbytes, 0, 5, 6)
    assert len(codec.encode(plain)) == len(frame) - len(random)


def test_random_states_are_words_of_ascii() -> None:
    assert wire.split_states(wire.join_states([STATE_A, STATE_B])) == [STATE_A, STATE_B]
    assert wire.split_states(b"") == []
    for bad in ("", "two words", "Philox_\u00e9"):
        with pytest.raises(ValueError, match="not a random generator state"):
            wire.join_states([bad])


# --------------------------------------------------------------------------- the state
def _state(**changes: Any) -> dict[str, Any]:
    state = make_state(
        sampling=SAMPLING,
        epoch=0,
        world_size=1,
        num_workers=2,
        received=[2, 1],
        history=[],
        steps=[3],
        random=[[STATE_A, STATE_B], []],
    )
    state.update(changes)
    return state


def _parse(state: dict[str, Any], workers: int = 2, **kwargs: Any) -> Any:
    return parse_state(
        state, sampling=SAMPLING, world_size=1, num_workers=workers, rank=0, **kwargs
    )


def test_a_state_gives_each_shard_its_random_states_on_the_same_layout_only() -> None:
    resume = _parse(_state())
    assert resume.random_states([0, 1]) == [wire.join_states([STATE_A, STATE_B]), b""]
    assert _parse(_state(), workers=3).random_states([0, 1, 2]) == [b"", b"", b""]
    older = _state()
    del older["random"]  # format 2 before random states were kept: loads, restores nothing
    assert _parse(older).random is None and _parse(older).random_states([0, 1]) == [b"", b""]


@pytest.mark.parametrize("bad", [[["a b"], []], [None, []], [[1], []], [[]]])
def test_a_state_with_bad_random_states_names_the_field(bad: list[Any]) -> None:
    with pytest.raises(ValueError, match=r"^random"):
        _parse(_state(random=bad))


def test_a_state_over_other_data_is_refused_naming_both_datasets(
    caplog: pytest.LogCaptureFixture,
) -> None:
    other = _state(sampling={"total": 30, "shuffle": True, "drop_last": False})
    other["sampling"]["fingerprint"] = "files:c3d4"
    mine = wire.Sampling(30, 4, 0, True, False, "files:a1b2")
    with pytest.raises(ValueError) as raised:
        parse_state(other, sampling=mine, world_size=1, num_workers=2, rank=0)
    assert str(raised.value).startswith(
        "dataset: the state was saved over 30 files whose list hashes to c3d4, this loader "
        "reads 30 files whose list hashes to a1b2"
    )
    assert "strict=False" in str(raised.value)
    caplog.set_level(logging.INFO, logger="loader")
    parse_state(other, sampling=mine, world_size=1, num_workers=2, rank=0, strict=False)
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.message.startswith("dataset: the state was saved over 30 files")
    user = _state()
    user["sampling"]["fingerprint"] = "v0"
    with pytest.raises(ValueError, match=r"fingerprint 'v0', this loader reads .* 'v1'"):
        _parse(user)


def test_a_state_without_a_fingerprint_loads_and_says_it_was_not_checked(
    caplog: pytest.LogCaptureFixture,
) -> None:
    older = _state()
    del older["sampling"]["fingerprint"]
    caplog.set_level(logging.INFO, logger="loader")
    _parse(older)
    assert any("no dataset fingerprint" in r.message for r in caplog.records)


# --------------------------------------------------------------------------- the worker side
_made: list[Any] = []


def _step(images: Any) -> tuple[Any, Any]:
    """The default RNG and one this step makes on its first call (eager)."""
    import nvidia.dali.experimental.dynamic as ndd

    if not _made:
        _made.append(ndd.random.RNG(seed=99))
    crop = ndd.random_resized_crop(images, size=[4, 4])
    flip = ndd.random.coin_flip(probability=0.5, batch_size=2, rng=_made[0])
    return crop, flip


def _run(start: int, states: bytes) -> tuple[list[bytes], list[bytes]]:
    """Steps ``start`` to 5 of a fresh "worker" whose sources start at ``states``."""
    import nvidia.dali.experimental.dynamic as ndd

    _made.clear()
    images = [np.full((6 + k, 7, 3), k, dtype=np.uint8) for k in range(2)]
    generators = RandomGenerators()
    try:
        dali.seed_random(5)
        generators.rebuilt(states)
        outputs, after = [], []
        for _ in range(start, 6):
            crop, flip = _step(ndd.batch(images, layout="HWC"))
            after.append(generators.after_step())
            data = [np.asarray(t).tobytes() for t in dali.storage_of(crop)]
            outputs.append(b"".join(data) + np.asarray(dali.storage_of(flip)[0]).tobytes())
        return outputs, after
    finally:
        generators.close()


def test_a_worker_resumes_its_generators_the_step_made_ones_included() -> None:
    outputs, after = _run(0, b"")
    assert [len(wire.split_states(states)) for states in after] == [2] * 6
    for start in (1, 4):
        resumed, resumed_after = _run(start, after[start - 1])
        assert resumed == outputs[start:]
        assert resumed_after == after[start:]
    fresh, _ = _run(4, b"")
    assert fresh != outputs[4:]  # (what a resume without the states gives)


def test_a_generators_key_is_its_seed() -> None:
    import nvidia.dali.experimental.dynamic as ndd

    generator = ndd.random.RNG(seed=99)
    before = dali.generator_state(generator)
    generator.advance(1000)
    assert dali.generator_key(dali.generator_state(generator)) == dali.generator_key(before)
    assert dali.generator_key(before) != dali.generator_key(
        dali.generator_state(ndd.random.RNG(seed=98))
    )


# --------------------------------------------------------------------------- dataset fingerprint
def _folder(root: Path, names: list[str]) -> Path:
    for name in names:
        (root / "a").mkdir(parents=True, exist_ok=True)
        (root / "a" / name).touch()
    when = time.time() - 60  # (an index of a folder changed in the last seconds is not kept)
    for folder in (root, root / "a"):
        os.utime(folder, (when, when))
    return root


def test_a_folders_fingerprint_is_made_with_its_index_and_read_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    first = _folder(tmp_path / "first", ["1.jpg", "2.jpg"])
    listed = open_folder(str(first))
    assert list((tmp_path / "cache" / "file-index").glob("*.index"))  # (kept: read back next)
    mapped = open_folder(str(first))
    assert listed.fingerprint == mapped.fingerprint and listed.fingerprint.startswith("files:")
    renamed = _folder(tmp_path / "renamed", ["1.jpg", "3.jpg"])
    assert open_folder(str(renamed)).fingerprint != listed.fingerprint
    moved = _folder(tmp_path / "moved", ["1.jpg", "2.jpg"])  # the same relative paths
    assert open_folder(str(moved)).fingerprint == listed.fingerprint


def test_a_lists_fingerprint_follows_its_paths_and_labels() -> None:
    files = ["/d/a.jpg", "/d/b.jpg"]
    # ``files:`` and 16 hex digits of the SHA-256 of the paths joined by NUL, then the labels as
    # little-endian int32: computed here from the paths and labels, not from a ListedFiles (a
    # state saved by another run, or another version, is checked against it)
    digest = hashlib.sha256(
        b"/d/a.jpg\0/d/b.jpg" + (0).to_bytes(4, "little") + (1).to_bytes(4, "little")
    )
    assert ListedFiles(files, [0, 1]).fingerprint == f"files:{digest.hexdigest()[:16]}"
    assert ListedFiles(files, [0, 1]).fingerprint != ListedFiles(files, [1, 0]).fingerprint
    assert ListedFiles(files, [0, 1]).fingerprint != ListedFiles(files[::-1], [0, 1]).fingerprint
