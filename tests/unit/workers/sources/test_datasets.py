"""One type per dataset kind (no workers): what a mixture takes is what sharded_* wraps."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from loader import SamplesDataset, Shard, sharded_mix


def _load(index: int, epoch: int = 0) -> Any:
    return np.array([index], dtype=np.int64)


def test_a_samples_dataset_opens_as_sharded_source_reads_it() -> None:
    shard = Shard.make(rank=0, world_size=1, worker=0, num_workers=1, seed=3)
    opened = SamplesDataset(10, _load, fingerprint="v1", pass_epoch=True).open(shard, 3)
    assert (opened.total, opened.num_outputs, opened.fingerprint) == (10, 1, "v1")
    assert opened.pass_epoch
    with pytest.raises(TypeError, match="fingerprint must be a str"):
        SamplesDataset(10, _load, fingerprint=5).open(shard, 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="total must be a positive number"):
        SamplesDataset(0, _load).open(shard, 3)


def test_a_mixture_refuses_a_dataset_that_wants_the_epoch() -> None:
    shard = Shard.make(rank=0, world_size=1, worker=0, num_workers=1, seed=0)
    with pytest.raises(ValueError, match="pass_epoch=True is not for a mixture"):
        sharded_mix(
            shard,
            {"a": SamplesDataset(10, _load, pass_epoch=True)},
            weights={"a": 1.0},
            batch_size=2,
        )


def test_each_definition_names_what_its_workers_will_open_for_the_server() -> None:
    """The worker server imports these before it forks the workers (``Prepare.needs``): the
    remote stores among the URLs, once each, and a format's library."""
    from pathlib import Path

    from loader import FilesDataset, MixDataset, ParquetDataset, TarsDataset

    ARROW = ("module:pyarrow.parquet", "module:pyarrow.compute")  # (compute: page reads)
    tars = TarsDataset(["s3://b/a-{0..3}.tar", "S3://b/c.tar", "gs://x/d.tar", "/local/e.tar"])
    assert tars.server_needs() == ("protocol:s3", "protocol:gs")
    assert TarsDataset(Path("/data/shards")).server_needs() == ()
    assert FilesDataset("/data/images").server_needs() == ()
    assert ParquetDataset("hf://datasets/org/name@main/*.parquet").server_needs() == (
        "protocol:hf",
        *ARROW,
    )
    assert ParquetDataset("/data/pq").server_needs() == ARROW
    assert SamplesDataset(10, _load).server_needs() == ()
    mix = MixDataset(
        {"a": tars, "b": ParquetDataset(["s3://b/x.parquet"]), "c": SamplesDataset(4, _load)},
        {"a": 1.0, "b": 1.0, "c": 1.0},
    )
    assert mix.server_needs() == ("protocol:s3", "protocol:gs", *ARROW)


def test_labels_that_are_not_one_int_per_file_are_refused_at_the_definition() -> None:
    """A float label was cut to an int silently, a str parsed, and one that is no number failed
    in every worker without naming ``labels=``."""
    from loader import FilesDataset

    files = ["a.jpg", "b.jpg"]
    with pytest.raises(TypeError, match=r"labels\[0\] is 0\.5 \(float\): labels= takes one int"):
        FilesDataset(files, labels=[0.5, 1])
    with pytest.raises(TypeError, match=r"labels\[1\] is '2' \(str\)"):
        FilesDataset(files, labels=[1, "2"])
    with pytest.raises(ValueError, match=r"labels\[0\] is 1099511627776, past int32"):
        FilesDataset(files, labels=[2**40, 1])
    with pytest.raises(ValueError, match=r"2 files but 3 labels: give one per file"):
        FilesDataset(files, labels=[1, 2, 3])
    assert FilesDataset(files, labels=[np.int64(3), 1]).labels is not None
