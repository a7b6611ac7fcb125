"""probe_reader against real DALI readers, in this process: what each shard really yields."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import nvidia.dali.experimental.dynamic as ndd
import pytest

from loader.sample import list_images, write_sample_dataset
from workers import dali


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """200 small JPEGs; a test takes the first N of them."""
    root = write_sample_dataset(tmp_path_factory.mktemp("shards"), count=200, classes=2, seed=1)
    found, _labels = list_images(root)
    return found


def make_reader(files: list[str], shard: int, shards: int, **kwargs: Any) -> Any:
    """A File reader that sticks to its shard and pads; a sample's label is its file's index."""
    return ndd.readers.File(
        files=files,
        labels=list(range(len(files))),
        shard_id=shard,
        num_shards=shards,
        stick_to_shard=True,
        pad_last_batch=True,
        **kwargs,
    )


def read_epoch(reader: Any, batch_size: int, ctx: Any, capture: bool) -> list[list[int]]:
    """One epoch through the worker's own entry point: the labels of each batch."""
    batches = []
    for _jpegs, labels in dali.epoch_iterator(reader, batch_size, ctx, capture):
        if capture:
            labels = ndd.cast(labels, dtype=ndd.int64)  # something for capture mode to capture
        rows = np.asarray(dali.storage_of(labels).as_array()).ravel()
        batches.append([int(v) for v in rows])
    return batches


# File counts that divide the shard count and that do not, with 1-4 shards; batch sizes that
# divide the shard sizes, do not, and exceed them; eager and capture mode.
@pytest.mark.parametrize("shards", [1, 2, 3, 4])
@pytest.mark.parametrize("count", [12, 13, 10, 7])
def test_probe_matches_what_each_shard_yields(files: list[str], count: int, shards: int) -> None:
    ctx = dali.make_context(1, None)
    for batch_size in (1, 3, 5):
        for capture in (False, True):
            case = f"{count} files, {shards} shards, batch {batch_size}, capture={capture}"
            seen: list[int] = []
            steps = set()
            for shard in range(shards):
                reader = make_reader(files[:count], shard, shards, max_batch_size=batch_size)
                probed = dali.probe_reader(reader, batch_size)
                assert isinstance(probed, dali.ReaderShard)
                for epoch in range(2):
                    batches = read_epoch(reader, batch_size, ctx, capture)
                    where = f"{case}, shard {shard}, epoch {epoch}: {probed} {batches}"
                    assert len(batches) == probed.steps, where
                    assert all(len(batch) == batch_size for batch in batches), where
                    rows = [label for batch in batches for label in batch]
                    real, padding = rows[: probed.real], rows[probed.real :]
                    # The first `real` rows are this shard's files, each once, in order...
                    assert real == list(range(real[0], real[0] + probed.real)), where
                    # ... and every row after them repeats the shard's last file.
                    assert padding == [real[-1]] * len(padding), where
                    if capture:
                        assert dali.capture_state(reader, capture) == "captured", where
                seen += real
                steps.add(probed.steps)
            # The shards split the files: each file in exactly one shard.
            assert seen == list(range(count)), case
            # Every shard yields as many batches as the largest one, shorter shards included.
            assert steps == {math.ceil(math.ceil(count / shards) / batch_size)}, case


def test_a_shorter_shard_reports_its_own_size(files: list[str]) -> None:
    """200 files over 3 shards: 66, 67 and 67 real samples, 9 batches of 8 each."""
    probed = [
        dali.probe_reader(make_reader(files, shard, 3, max_batch_size=8), 8) for shard in range(3)
    ]
    assert probed == [dali.ReaderShard(real=real, steps=9) for real in (66, 67, 67)]


def test_probe_rejects_a_reader_built_for_another_batch_size(files: list[str]) -> None:
    reader = make_reader(files[:12], 0, 2, max_batch_size=4)
    with pytest.raises(ValueError, match=r"max_batch_size=4 but the Loader's batch_size is 2"):
        dali.probe_reader(reader, 2)


@pytest.mark.parametrize("capture", [False, True], ids=["eager", "capture"])
def test_probe_gives_a_reader_without_max_batch_size_the_loop_batch_size(
    files: list[str], capture: bool
) -> None:
    reader = make_reader(files[:12], 1, 2)
    assert dali.probe_reader(reader, 4) == dali.ReaderShard(real=6, steps=2)
    batches = read_epoch(reader, 4, dali.make_context(1, None), capture)
    assert batches == [[6, 7, 8, 9], [10, 11, 11, 11]]


def test_probe_ignores_an_external_source() -> None:
    assert dali.probe_reader(ndd.ExternalSource(source=iter([])), 2) is None
