"""Reading never writes where the data lives unless asked: a job over tar shards that have no
index keeps what it learns (each shard's index, the summary) in the node's cache, so that a
second job scans nothing, and leaves the shards' directory, or bucket, as it found it; asked to
(``publish_index=True``), it writes them beside the shards as the index command does. Local
shards, and shards on an S3-protocol server (moto's, on 127.0.0.1) behind a counting proxy."""

from __future__ import annotations

import logging
import re
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loader import Loader, TarsDataset
from tests import tar_pipelines as T
from workers.sources.storage import CACHE_DIR_ENV
from workers.sources.tars._summary import SUMMARY

pytestmark = pytest.mark.timeout(300)

_SCANNED = re.compile(r"(^|: )indexed \S+\.tar: \d+ samples in ")


def _run(dataset: TarsDataset, workers: int = 2) -> list[int]:
    """One epoch of ``dataset``'s ids (batches of 4, ``workers`` workers)."""
    with Loader(dataset, T.cls_id_step, batch_size=4, num_workers=workers, copy=True) as loader:
        return sorted(i for batch in loader for i in _ids(batch))


def _ids(batch: Any) -> list[int]:
    values = [int(v) for v in np.asarray(batch["id"]).ravel()]
    return values[: len(values) - batch.info.padded]


def _as_it_is(directory: Path) -> tuple[list[tuple[str, int, int]], int]:
    """Each entry's name, size and mtime, and the directory's own mtime."""
    entries = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in directory.iterdir())
    return entries, directory.stat().st_mtime_ns


def _scans(caplog: pytest.LogCaptureFixture) -> int:
    return sum(1 for r in caplog.records if _SCANNED.search(r.getMessage()))


@pytest.mark.parametrize("mode", ["writable", "read-only"])
def test_a_job_over_unindexed_local_tars_leaves_their_directory_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, mode: str
) -> None:
    """4 shards without an index, 2 workers, two jobs one after the other on one node: the
    first scans each shard once, the second none (the node's cache); the directory is the same,
    entry by entry (names, sizes, mtimes), after both."""
    data = tmp_path / "data"
    T.write_id_tars(data, 28, 7)
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    caplog.set_level(logging.INFO, logger="loader")  # (workers log at the trainer's level)
    before = _as_it_is(data)
    dataset = TarsDataset(str(data / "train-{000..003}.tar"), ext=("cls", "id"))
    if mode == "read-only":
        for path in data.iterdir():
            path.chmod(0o444)
        data.chmod(0o555)
    try:
        assert _run(dataset) == list(range(28))
        assert _scans(caplog) == 4  # (each shard once, by one worker or the other)
        caplog.clear()
        assert _run(dataset) == list(range(28))
        assert _scans(caplog) == 0  # (the node's cache: its indexes and summary)
    finally:
        data.chmod(0o755)
        for path in data.iterdir():
            path.chmod(0o644)
    assert _as_it_is(data) == before
    assert (tmp_path / "cache" / "tar-index").is_dir()


def test_asked_to_publish_a_job_writes_the_indexes_and_summary_beside_the_shards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``publish_index=True``: the ``.idx`` of each shard and the summary beside them, which
    another node (a cache of its own) then reads: no scan."""
    data = tmp_path / "data"
    T.write_id_tars(data, 28, 7)
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    caplog.set_level(logging.INFO, logger="loader")
    pattern = str(data / "train-{000..003}.tar")
    assert _run(TarsDataset(pattern, ext=("cls", "id"), publish_index=True)) == list(range(28))
    assert sorted(p.name for p in data.iterdir() if p.suffix != ".tar") == [SUMMARY] + [
        f"train-{k:03d}.idx" for k in range(4)
    ]
    assert _scans(caplog) == 4
    caplog.clear()
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "another-node"))
    assert _run(TarsDataset(pattern, ext=("cls", "id"))) == list(range(28))
    assert _scans(caplog) == 0


class _Bucket:
    """A bucket of its own on moto's server, behind a proxy that counts requests."""

    def __init__(self) -> None:
        pytest.importorskip("s3fs")
        pytest.importorskip("moto.server")
        from bench._s3 import CountingProxy, S3Server

        self.server = S3Server(threaded=True)
        self.proxy = CountingProxy(self.server.endpoint)
        self.name = f"read-only-{uuid.uuid4().hex[:12]}"
        self.server.bucket(self.name)

    def objects(self) -> dict[str, tuple[int, str]]:
        """Each object's size and ETag, asked of the server straight."""
        client = self.server.client()
        try:
            found = client.list_objects_v2(Bucket=self.name).get("Contents", [])
        finally:
            client.close()
        return {o["Key"]: (int(o["Size"]), str(o["ETag"])) for o in found}

    def close(self) -> None:
        self.proxy.close()
        self.server.close()


@pytest.fixture
def bucket() -> Iterator[_Bucket]:
    made = _Bucket()
    try:
        yield made
    finally:
        made.close()


def _kinds(served: list[Any]) -> Counter[str]:
    return Counter(
        "LIST" if "list-type" in s.query else f"{s.method} .{s.name.rsplit('.', 1)[-1]}"
        for s in served
    )


def test_a_job_over_unindexed_shards_in_a_writable_bucket_writes_nothing_into_it(
    bucket: _Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """16 shards without an index in a bucket the job may write, 2 workers, two jobs on one
    node: the bucket holds the same objects after both (no PUT at all); the first job reads
    each shard whole once to index it, the second reads the node's cache instead (no listing,
    only the shards its first batches need)."""
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "node-cache"))
    paths = T.write_payload_tars(tmp_path / "tars", 16, 4, 200)
    bucket.server.bucket(bucket.name, paths)
    before = bucket.objects()
    assert sorted(before) == [p.name for p in paths]
    dataset = TarsDataset(
        f"s3://{bucket.name}/train-{{0000..0015}}.tar",
        ext=("cls", "id"),
        storage_options=bucket.server.options(bucket.proxy.endpoint),
    )
    firsts = []
    for _job in range(2):
        bucket.proxy.reset()
        with Loader(dataset, T.cls_id_step, batch_size=4, num_workers=2, copy=True) as loader:
            batches = iter(loader)
            seen = _ids(next(batches))
            firsts.append(_kinds(bucket.proxy.records()))
            seen += [i for batch in batches for i in _ids(batch)]
        assert sorted(seen) == list(range(64))
        written = [s for s in bucket.proxy.records() if s.method in ("PUT", "POST", "DELETE")]
        assert not written, written
    assert bucket.objects() == before
    assert firsts[0]["GET .tar"] >= 16, firsts[0]  # (every shard read whole, to index it)
    assert firsts[1]["LIST"] == 0 and firsts[1]["GET .tar"] < 16, firsts[1]
