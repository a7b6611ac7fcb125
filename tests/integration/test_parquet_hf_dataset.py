"""A Hugging Face ``datasets.Dataset`` in place of Parquet files: its memory-mapped Arrow files
read where they lie, through workers, every row once per epoch, its fingerprint in the state."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("datasets")

from loader import Loader, ParquetDataset
from tests import parquet_pipelines as P

pytestmark = pytest.mark.timeout(240)

ROWS = 250


def real(batch: Any, name: str) -> list[int]:
    values = [int(v) for v in np.asarray(batch[name]).ravel()]
    return values[: len(values) - batch.info.padded]


def loader_over(dataset: Any, workers: int = 2) -> Loader:
    definition = ParquetDataset(dataset, columns=("image", "label", "id"))
    return Loader(definition, P.decode_step, batch_size=4, num_workers=workers, copy=True)


def test_a_saved_dataset_is_read_where_it_lies_once_per_epoch_and_resumed(
    tmp_path: Path,
) -> None:
    dataset = P.saved_dataset(tmp_path / "saved", ROWS)
    assert len(dataset.cache_files) > 2
    before = sorted(os.listdir(tmp_path / "saved"))
    definition = ParquetDataset(dataset)
    sent = pickle.dumps(definition)  # (what the workers get: paths and the fingerprint)
    assert b"arrow_dataset" not in sent and len(sent) < 4096
    assert definition.urls.fingerprint == dataset._fingerprint
    with loader_over(dataset) as loader:
        epoch = [real(b, "id") for b in loader]
        iterator = iter(loader)
        taken = [real(next(iterator), "id") for _ in range(5)]
        state = json.loads(json.dumps(loader.state_dict()))
        stats = loader.stats()
    assert sorted(i for ids in epoch for i in ids) == list(range(ROWS))
    assert state["sampling"]["fingerprint"].startswith(f"hf-dataset:{dataset._fingerprint}:")
    with loader_over(dataset, workers=3) as loader:  # another layout: once each
        loader.load_state_dict(state)
        rest = [i for batch in loader for i in real(batch, "id")]
    assert sorted([i for ids in taken for i in ids] + rest) == list(range(ROWS))
    assert sorted(os.listdir(tmp_path / "saved")) == before  # (nothing written, nothing copied)
    assert stats.samples > 0


def test_images_and_labels_come_from_the_arrow_files(tmp_path: Path) -> None:
    dataset = P.saved_dataset(tmp_path / "saved", 40)
    with loader_over(dataset, workers=1) as loader:
        for batch in loader:
            for image, row, label in zip(
                batch["image"], real(batch, "id"), real(batch, "label"), strict=False
            ):
                assert abs(int(np.asarray(image)[..., 0].mean()) - row % 256) <= 3
                assert label == row % 3


def test_a_dataset_from_load_dataset_of_local_parquet_files(tmp_path: Path) -> None:
    import datasets

    paths = P.write_parquet(tmp_path / "parquet", (60, 40), 25)
    dataset = datasets.load_dataset(
        "parquet",
        data_files=[str(p) for p in paths],
        split="train",
        cache_dir=str(tmp_path / "hf-cache"),
    )
    with loader_over(dataset) as loader:
        seen = [i for batch in loader for i in real(batch, "id")]
    assert sorted(seen) == list(range(100))


def test_a_selection_or_a_dataset_in_memory_is_refused_saying_what_to_pass(
    tmp_path: Path,
) -> None:
    dataset = P.saved_dataset(tmp_path / "saved", 40)
    with pytest.raises(ValueError, match=r"flatten_indices\(\)"):
        ParquetDataset(dataset.shuffle(seed=1))
    with pytest.raises(ValueError, match=r"save_to_disk"):
        ParquetDataset(P.hf_dataset(range(10)))
    # a contiguous select() slices the tables, with no indices: refused as soon too
    with pytest.raises(ValueError, match=r"is a selection .*flatten_indices\(\)"):
        ParquetDataset(dataset.select(range(10)))
    one_file = P.saved_dataset(tmp_path / "one", 40, shard_bytes=10**9)  # (one Arrow file)
    with pytest.raises(ValueError, match=r"is a selection .*flatten_indices\(\)"):
        ParquetDataset(one_file.select(range(10)))
    import datasets

    splits = datasets.DatasetDict({"train": dataset, "test": dataset})  # (load_dataset, no split)
    with pytest.raises(TypeError, match=r"dict of splits \('train', 'test'\): pass one split"):
        ParquetDataset(splits)


def test_a_state_is_refused_over_the_same_dataset_saved_again_in_other_files(
    tmp_path: Path,
) -> None:
    """``save_to_disk`` keeps ``datasets``' fingerprint whatever the files, but the epochs,
    dealt by record batch, are others: resumed there, samples came twice and never."""
    import datasets

    rows = P.hf_dataset(range(60))
    rows.save_to_disk(str(tmp_path / "three"), num_shards=3)
    three = datasets.load_from_disk(str(tmp_path / "three"))
    with loader_over(three) as loader:
        iterator = iter(loader)
        for _ in range(4):
            next(iterator)
        state = json.loads(json.dumps(loader.state_dict()))
    rows.save_to_disk(str(tmp_path / "one"), num_shards=1)
    one = datasets.load_from_disk(str(tmp_path / "one"))
    assert one._fingerprint == three._fingerprint  # (what made it pass as the same data)
    with loader_over(one) as loader, pytest.raises(ValueError, match=r"data-00000-of-00003"):
        loader.load_state_dict(state)


def test_columns_changed_in_memory_over_the_files_are_refused_at_the_definition(
    tmp_path: Path,
) -> None:
    """The loader reads the Arrow files; what ``datasets`` keeps in memory over them (a rename,
    a cast, a column added) would give other values than the ``Dataset`` shows."""
    import datasets

    dataset = P.saved_dataset(tmp_path / "saved", 40)
    columns = ("image", "label", "id")
    swapped = dataset.rename_columns({"label": "id", "id": "label"})
    with pytest.raises(ValueError, match=r"renamed column 'label' to 'id' in memory.*flatten_"):
        ParquetDataset(swapped, columns=columns)
    with pytest.raises(ValueError, match=r"has no column 'label'; its columns: image, id"):
        ParquetDataset(dataset.remove_columns("label"), columns=columns)
    datasets.Dataset.from_dict({"path": ["a.jpg", "b.jpg"]}).save_to_disk(str(tmp_path / "paths"))
    paths = datasets.load_from_disk(str(tmp_path / "paths")).cast_column("path", datasets.Image())
    with pytest.raises(ValueError, match=r"casts column 'path' from string to struct<bytes"):
        ParquetDataset(paths, columns=("path",))  # (its bytes were the path's)
    with pytest.raises(ValueError, match=r"held in memory, not in its Arrow files"):
        ParquetDataset(dataset.add_column("extra", list(range(40))), columns=columns)
    with pytest.raises(ValueError, match=r"held in memory, not in its Arrow files"):
        ParquetDataset(datasets.concatenate_datasets([dataset, P.hf_dataset(range(40, 48))]))
    sides = [dataset.select_columns(["image", "label"]), dataset.select_columns(["id"])]
    with pytest.raises(ValueError, match=r"several Arrow files side by side"):
        ParquetDataset(datasets.concatenate_datasets(sides, axis=1), columns=columns)
    with pytest.warns(UserWarning, match=r"transform .* is not applied"):
        ParquetDataset(dataset.with_transform(lambda batch: batch), columns=columns)
    # what leaves the columns read as the files hold them: read, each row once
    kept = dataset.cast_column("image", datasets.Image(decode=False)).select_columns(
        ["id", "image", "label"]
    )
    with loader_over(kept, workers=1) as loader:
        seen = [i for batch in loader for i in real(batch, "id")]
    assert sorted(seen) == list(range(40))


def test_a_relative_image_path_is_opened_from_the_working_directory_as_datasets_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ``Image`` row holding a relative path and no bytes (``from_generator`` of paths):
    ``datasets`` opens it from the working directory, not beside its cached Arrow file."""
    import datasets

    monkeypatch.chdir(tmp_path)
    (tmp_path / "img").mkdir()
    for i in range(12):
        (tmp_path / "img" / f"{i}.jpg").write_bytes(P.jpeg(i * 10))

    def rows() -> Any:
        for i in range(12):
            yield {"image": f"img/{i}.jpg", "label": i % 3, "id": i}

    features = datasets.Features(
        {
            "image": datasets.Image(),
            "label": datasets.ClassLabel(names=P.NAMES),
            "id": datasets.Value("int64"),
        }
    )
    dataset = datasets.Dataset.from_generator(
        rows, features=features, cache_dir=str(tmp_path / "cache")
    )
    beside = Path(dataset.cache_files[0]["filename"]).parent / "img"
    beside.mkdir()  # (other images under the same names, beside the Arrow file)
    for i in range(12):
        (beside / f"{i}.jpg").write_bytes(P.jpeg(255 - i))
    assert np.asarray(dataset[3]["image"])[..., 0].mean() == pytest.approx(30, abs=3)
    with loader_over(dataset, workers=1) as loader:
        for batch in loader:
            for image, row in zip(batch["image"], real(batch, "id"), strict=False):
                assert abs(int(np.asarray(image)[..., 0].mean()) - row * 10) <= 3
