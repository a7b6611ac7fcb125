"""sharded_mix: exact per-source counts per epoch, resume and reshard, checked outputs."""

from __future__ import annotations

import functools
import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loader import Loader, write_tars
from tests import tar_pipelines as T

pytestmark = pytest.mark.timeout(240)


def rows(batch: Any) -> list[tuple[int, int]]:
    """(source, id) of each real row."""
    real = len(batch["id"]) - batch.info.padded
    ids = np.asarray(batch["id"]).ravel()[:real]
    sources = np.asarray(batch["source"]).ravel()[:real]
    return list(zip(sources.tolist(), ids.tolist(), strict=True))


def make(workers: int = 2, **kw: Any) -> Loader:
    source = functools.partial(T.id_mix, **kw)
    return Loader(source, T.id_source_step, batch_size=4, num_workers=workers, copy=True)


def test_every_epoch_takes_exact_counts_without_replacement() -> None:
    # 48 per epoch: 36 of the 60-sample source, 12 of the 12-sample one (all of it, once)
    with make() as loader:
        assert len(loader) == 12
        epochs = [[r for b in loader for r in rows(b)] for _ in range(3)]
    for epoch in epochs:
        assert Counter(source for source, _id in epoch) == {0: 36, 1: 12}
        assert sorted(i for s, i in epoch if s == 1) == list(range(1000, 1012))
        assert all(i < 60 for s, i in epoch if s == 0)
    # the big source's running permutation: epochs 0 and 1 take 72 of its 60 samples, each
    # sample once before any repeats
    big = [i for epoch in epochs[:2] for s, i in epoch if s == 0]
    assert Counter(Counter(big).values()) == {1: 48, 2: 12}


def test_an_interrupted_epoch_resumed_on_another_layout_keeps_the_counts() -> None:
    with make() as loader:
        uninterrupted = [r for b in loader for r in rows(b)]
    with make() as loader:
        iterator = iter(loader)
        taken = [r for _ in range(3) for r in rows(next(iterator))]
        state = json.loads(json.dumps(loader.state_dict()))
    assert state["sampling"]["fingerprint"].startswith("mix2:")
    with make(workers=3) as loader:
        loader.load_state_dict(state)
        rest = [r for b in loader for r in rows(b)]
    assert Counter(taken + rest) == Counter(uninterrupted)
    with make() as loader:  # the same layout: the same stream
        loader.load_state_dict(state)
        assert taken + [r for b in loader for r in rows(b)] == uninterrupted


def test_sources_with_other_outputs_or_bad_weights_are_refused_naming_them() -> None:
    with pytest.raises(ValueError, match=r"output 0 of source 'src1' is float32 of rank 1"):
        make(dtypes=("int64", "float32"))
    with pytest.raises(ValueError, match=r"mixes integers no integer type holds all of"):
        make(dtypes=("int64", "uint64"))
    with pytest.raises(ValueError, match=r"takes none from \['src1'\]"):
        make(weights=(0.99, 0.01), epoch_size=20)


def test_integers_of_other_widths_mix_cast_to_the_wider() -> None:
    """A tar's int32 ``cls`` beside a Parquet int64 ``label``: cast to int64 (they were refused,
    and neither definition can choose its integers' width)."""
    with make(dtypes=("int64", "int32")) as loader:
        epoch = [r for b in loader for r in rows(b)]
    assert Counter(source for source, _id in epoch) == {0: 36, 1: 12}
    assert sorted(i for s, i in epoch if s == 1) == list(range(1000, 1012))


def test_parquet_and_tars_mix_by_position_though_named_otherwise(tmp_path: Path) -> None:
    """``ParquetDataset(columns=("image", "label", "id"))`` beside ``TarsDataset(ext=("jpg",
    "cls", "id"))``: the outputs go to the step by position (they were refused for their names,
    then for int64 against int32); every row of both once, each image with its own id."""
    pytest.importorskip("pyarrow")
    pytest.importorskip("datasets")
    from tests import parquet_pipelines as P

    P.write_parquet(tmp_path / "pq", (20,), 10)  # ids 0-19, label id % 3
    T.write_image_tars(tmp_path / "tars", range(100, 112), 6)  # ids 100-111, cls id % 3
    source = functools.partial(
        T.parquet_and_tars_mix, parquet=str(tmp_path / "pq"), tars=str(tmp_path / "tars")
    )
    with Loader(source, T.decode_label_id_step, batch_size=4, num_workers=2, copy=True) as loader:
        seen = []
        for batch in loader:
            real = len(batch["id"]) - batch.info.padded
            ids = np.asarray(batch["id"]).ravel()[:real].tolist()
            labels = np.asarray(batch["label"]).ravel()[:real].tolist()
            assert labels == [i % 3 for i in ids]
            assert all(np.asarray(image).shape[-1] == 3 for image in batch["image"][:real])
            seen += ids
    assert sorted(seen) == list(range(20)) + list(range(100, 112))


def test_a_folder_and_tar_shards_mixed_half_and_half(image_root: Path, tmp_path: Path) -> None:
    write_tars(image_root, tmp_path / "tars", samples_per_shard=16)
    source = functools.partial(
        T.files_and_tars_mix,
        root=str(image_root),
        urls=str(tmp_path / "tars" / "train-{000000..000002}.tar"),
    )
    with Loader(source, T.decode_source_step, batch_size=4, num_workers=2, copy=True) as loader:
        assert len(loader) == 24  # 96 samples: 48 of each
        seen = Counter()
        labels = Counter()
        for batch in loader:
            real = len(batch["label"]) - batch.info.padded
            seen.update(np.asarray(batch["source"]).ravel()[:real].tolist())
            labels.update(np.asarray(batch["label"]).ravel()[:real].tolist())
    assert seen == {0: 48, 1: 48}
    assert labels == {0: 32, 1: 32, 2: 32}  # each class's 16 images, from both sources


def test_bytes_beside_integers_are_refused_not_read_as_numbers() -> None:
    """A tar's ``__key__`` (bytes: uint8) at the position of a Parquet int64: each key came
    as an array of its characters' codes, cast to int64, silently."""
    with pytest.raises(ValueError, match=r"gives uint8 of rank 1.*bytes, uint8, are bytes"):
        make(dtypes=("uint8", "int64"))


def test_a_worker_whose_part_of_a_mixed_epoch_is_empty_pads_as_a_dataset_does() -> None:
    """3 batches of 4 over 5 workers: two workers have no row of the epoch (a resume near an
    epoch's end onto more workers too); they failed at the start (a zero-size minimum)."""
    with make(workers=5, sizes=(10, 6), epoch_size=12) as loader:
        epoch = [r for b in loader for r in rows(b)]
    assert Counter(source for source, _id in epoch) == {0: 9, 1: 3}
    assert len(set(epoch)) == 12


def test_weights_must_be_a_dict_of_finite_positive_numbers() -> None:
    from loader import MixDataset, SamplesDataset

    sources = {"a": SamplesDataset(4, T.Ids(0, "int64")), "b": SamplesDataset(4, T.Ids(9, "int64"))}
    with pytest.raises(ValueError, match=r"weight of 'b' must be a finite number > 0, got inf"):
        MixDataset(sources, {"a": 1.0, "b": float("inf")})
    with pytest.raises(TypeError, match=r"weights must be a dict .*'a': 1.0, 'b': 1.0.*got list"):
        MixDataset(sources, [0.5, 0.5])  # type: ignore[arg-type]


def test_a_state_of_the_mix_saved_by_0_3_applies_between_epochs_only() -> None:
    """0.3's mixes drew a source's later permutations without keeping them apart from the ones
    before (``mix:`` fingerprints): taken mid-epoch, such a state owes other samples than this
    order gives, and is refused saying what to do; taken between epochs it applies."""
    with make() as loader:
        iterator = iter(loader)
        for _ in range(3):
            next(iterator)
        state = json.loads(json.dumps(loader.state_dict()))
        del iterator
        for _ in loader:  # (the epoch's rest: between epochs now)
            pass
        between = json.loads(json.dumps(loader.state_dict()))
        uninterrupted = [r for b in loader for r in rows(b)]
    for saved in (state, between):
        fingerprint = saved["sampling"]["fingerprint"]
        saved["sampling"]["fingerprint"] = "mix:" + fingerprint.removeprefix("mix2:")
    with make() as loader:
        with pytest.raises(ValueError, match=r"mid-epoch over this mix by a loader before 0\.4"):
            loader.load_state_dict(state)
        loader.load_state_dict(between)
        assert [r for b in loader for r in rows(b)] == uninterrupted
