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
