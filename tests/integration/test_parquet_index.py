"""The index command over Parquet files (``python -m loader index``): the summary it writes beside
them makes a job's start cost the same requests at 3 and at 30 files (a real S3-protocol server,
moto's on 127.0.0.1, behind a counting proxy; real s3fs in the workers); a file changed since is
named; a summary that lies is named with the command that mends it; without a summary, a start
reads the footers as before."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import uuid
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("datasets")
pytest.importorskip("boto3")
pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from loader import Loader
from loader.cli import main as cli
from tests import parquet_pipelines as P

pytestmark = pytest.mark.timeout(300)

SUMMARY = "loader-parquet-summary.json"


def ids(batch: Any) -> list[int]:
    values = [int(v) for v in np.asarray(batch["id"]).ravel()]
    return values[: len(values) - batch.info.padded]


class Store:
    """A bucket of its own on an S3-protocol server, behind a counting proxy."""

    def __init__(self) -> None:
        from bench._s3 import CountingProxy, S3Server

        self.server = S3Server(threaded=True)
        self.proxy = CountingProxy(self.server.endpoint)
        self.bucket = f"pq-index-{uuid.uuid4().hex[:12]}"
        self.server.bucket(self.bucket)
        self.options = self.server.options(self.proxy.endpoint)
        self.url = f"s3://{self.bucket}"

    def upload(self, paths: list[Path]) -> None:
        client = self.server.client()
        try:
            for path in paths:
                client.upload_file(str(path), self.bucket, path.name)
        finally:
            client.close()

    def index(self) -> int:
        """``python -m loader index`` straight to the server (not counted)."""
        options = json.dumps(self.server.options())
        done = subprocess.run(
            [sys.executable, "-m", "loader", "index", self.url, "--storage-options", options],
            capture_output=True,
            text=True,
        )
        assert "files indexed" in done.stdout, done.stdout + done.stderr
        return done.returncode

    def loader(self) -> Loader:
        source = functools.partial(P.id_parquet, urls=self.url, storage_options=self.options)
        return Loader(source, P.label_id_step, batch_size=4, num_workers=1, copy=True)

    def close(self) -> None:
        self.proxy.close()
        self.server.close()


def start_requests(tmp_path: Path, files: int) -> tuple[tuple[int, int], list[int]]:
    """The requests a start makes before its first batch over ``files`` indexed files (those
    that are not reads of row groups; the reads of row groups, which the read-ahead may have
    begun by then), and the epoch's ids."""
    store = Store()
    try:
        store.upload(P.write_parquet(tmp_path / f"data{files}", [20] * files, 10))
        assert store.index() == 0
        store.proxy.reset()
        with store.loader() as loader:
            iterator = iter(loader)
            seen = ids(next(iterator))
            before = store.proxy.records()
            seen += [i for batch in iterator for i in ids(batch)]
        # no listing and no footer: the summary (once), then row groups
        assert not [s for s in before if s.method == "GET" and "list-type" in s.query], before
        assert len([s for s in before if s.name == SUMMARY]) == 1, before
        reads = [s for s in before if s.name.endswith(".parquet")]
        return (len(before) - len(reads), len(reads)), seen
    finally:
        store.close()


def test_after_the_index_command_a_start_costs_the_same_at_3_and_at_30_files(
    tmp_path: Path,
) -> None:
    few, seen_few = start_requests(tmp_path, 3)
    many, seen_many = start_requests(tmp_path, 30)
    assert sorted(seen_few) == list(range(60))
    assert sorted(seen_many) == list(range(600))
    assert few[0] == many[0], (few, many)  # the summary and nothing else that grows
    # row groups: the first batch's, the next batch's (the worker loads it while DALI works
    # on the first: a batch of 4 may straddle two row groups of 10) and what the read-ahead
    # (ahead=2) has begun by then: a few, however many files (60 row groups at 30 files)
    assert 1 <= few[1] <= 5 and 1 <= many[1] <= 5, (few, many)


def test_a_file_changed_since_the_index_is_named_with_the_command(tmp_path: Path) -> None:
    store = Store()
    try:
        paths = P.write_parquet(tmp_path / "data", [20, 20], 10)
        store.upload(paths)
        assert store.index() == 0
        other = P.write_parquet(tmp_path / "other", [30], 10, prefix="train")
        other[0].rename(paths[1])  # (another file, written in its place)
        store.upload([paths[1]])
        with pytest.raises(Exception, match=r"train-00001\.parquet changed since it was indexed"):
            with store.loader() as loader:
                for _ in loader:
                    pass
        with pytest.raises(Exception, match=r"python -m loader index"):
            with store.loader() as loader:
                for _ in loader:
                    pass
        assert store.index() == 0  # (the command mends it)
        with store.loader() as loader:
            assert len([i for batch in loader for i in ids(batch)]) == 50
    finally:
        store.close()


def test_a_file_removed_since_the_index_is_named_with_the_summary_and_the_command(
    tmp_path: Path,
) -> None:
    store = Store()
    try:
        paths = P.write_parquet(tmp_path / "data", [20, 20], 10)
        store.upload(paths)
        assert store.index() == 0
        client = store.server.client()
        client.delete_object(Bucket=store.bucket, Key=paths[1].name)
        client.close()
        removed = (
            r"train-00001\.parquet does not exist .*removed since the summary .*"
            r"loader-parquet-summary\.json that names it was written; run python -m loader index"
        )
        with pytest.raises(Exception, match=removed):
            with store.loader() as loader:
                for _ in loader:
                    pass
        assert store.index() == 0  # (the command mends it)
        with store.loader() as loader:
            assert sorted(i for batch in loader for i in ids(batch)) == list(range(20))
    finally:
        store.close()


def test_without_a_summary_a_start_reads_the_footers(tmp_path: Path) -> None:
    store = Store()
    try:
        store.upload(P.write_parquet(tmp_path / "data", [20, 20, 20], 10))
        with store.loader() as loader:
            assert sorted(i for batch in loader for i in ids(batch)) == list(range(60))
        footers = [s for s in store.proxy.records() if s.range.endswith("-") or "bytes=" in s.range]
        assert footers  # (footers and row groups read by ranges)
        assert not [s for s in store.proxy.records() if s.method == "PUT"]  # nothing written
    finally:
        store.close()


def local_loader(directory: Path) -> Loader:
    source = functools.partial(P.id_parquet, urls=str(directory))
    return Loader(source, P.label_id_step, batch_size=4, num_workers=1, copy=True)


def test_a_local_summary_that_lies_is_named_with_the_command_that_mends_it(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "data"
    P.write_parquet(directory, [20, 20], 10)
    assert cli(["index", str(directory)]) == 0
    summary = directory / SUMMARY
    document = json.loads(summary.read_text())
    assert document["huggingface"]["info"]["features"]["label"]["_type"] == "ClassLabel"
    assert [len(row[4]) for row in document["files"]] == [2, 2]
    document["files"][1][4][0][0] = 11  # (a row group's rows, edited)
    summary.write_text(json.dumps(document))
    lies = r"summary .* is wrong about .*train-00001\.parquet.*--force"
    with pytest.raises(Exception, match=lies):
        with local_loader(directory) as loader:
            next(iter(loader))
    assert cli(["index", str(directory), "--force"]) == 0
    with local_loader(directory) as loader:
        assert sorted(i for batch in loader for i in ids(batch)) == list(range(40))


def test_a_local_file_rewritten_after_the_index_is_named_and_read_as_it_is(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "data"
    paths = P.write_parquet(directory, [20, 20], 10)
    assert cli(["index", str(directory)]) == 0
    other = P.write_parquet(tmp_path / "other", [20, 30], 10)
    other[1].rename(paths[1])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with local_loader(directory) as loader:
            seen = sorted(i for batch in loader for i in ids(batch))
    assert seen == list(range(20)) + list(range(20, 50))
    told = [str(w.message) for w in caught if "stale" in str(w.message)]
    assert told and "train-00001.parquet" in told[0] and "python -m loader index" in told[0]


def test_a_file_touched_after_the_index_is_named_with_its_times(tmp_path: Path) -> None:
    """The same size, another mtime: the warning says when each was modified (it showed the
    mtimes in nanoseconds)."""
    import os

    paths = P.write_parquet(tmp_path, [20, 20], 10)
    assert cli(["index", str(tmp_path)]) == 0
    os.utime(paths[0], ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with local_loader(tmp_path) as loader:
            assert sorted(i for batch in loader for i in ids(batch)) == list(range(40))
    told = [str(w.message) for w in caught if "stale" in str(w.message)]
    assert told and "train-00000.parquet (modified 20" in told[0], told
    assert "-> modified 2023-11-1" in told[0] and "mtime:" not in told[0], told


def requested_chunks(paths: list[Path]) -> tuple[int, int]:
    """Row groups of ``paths``, and the bytes of their requested columns' chunks."""
    import pyarrow.parquet as pq

    groups = chunks = 0
    for path in paths:
        meta = pq.ParquetFile(path).metadata
        for k in range(meta.num_row_groups):
            groups += 1
            row_group = meta.row_group(k)
            chunks += sum(
                row_group.column(c).total_compressed_size
                for c in range(row_group.num_columns)
                if row_group.column(c).path_in_schema in ("label", "id")
            )
    return groups, chunks


def epoch_reads(source: Any, epochs: int) -> list[tuple[int, int, int]]:
    """(row groups, requests, bytes) that ``stats()`` counts for each of ``epochs`` epochs of
    the 75 ids (one worker)."""
    counts, before = [], (0, 0, 0)
    with Loader(source, P.label_id_step, batch_size=4, num_workers=1, copy=True) as loader:
        for _ in range(epochs):
            assert sorted(i for batch in loader for i in ids(batch)) == list(range(75))
            stats = loader.stats()
            now = (stats.row_groups_read, stats.read_requests, stats.bytes_read)
            counts.append((now[0] - before[0], now[1] - before[1], now[2] - before[2]))
            before = now
            assert stats.workers[0].row_groups_read == stats.row_groups_read
    return counts


def check_epoch_reads(counts: list[tuple[int, int, int]], groups: int, chunks: int) -> None:
    """Every epoch -- the first too -- reads each row group once, with one request, and the
    bytes of the requested columns' chunks (within 5%); the next epoch's read-ahead is counted
    with that epoch, not with the one before it."""
    for epoch, (units, requests, nbytes) in enumerate(counts):
        assert units == groups, (epoch, counts, groups)
        assert requests == units, (epoch, counts)
        assert chunks <= nbytes <= 1.05 * chunks, (epoch, counts, chunks)


def test_stats_count_the_row_groups_requests_and_bytes_of_an_epoch(tmp_path: Path) -> None:
    """Over epochs on S3, ``stats()`` counts every row group once per epoch (the first too),
    one request each, and the bytes of the requested columns' chunks (within 5%)."""
    store = Store()
    try:
        paths = P.write_parquet(tmp_path / "data", [30, 20, 25], 10)  # (8 row groups)
        store.upload(paths)
        source = functools.partial(P.id_parquet, urls=store.url, storage_options=store.options)
        check_epoch_reads(epoch_reads(source, 3), *requested_chunks(paths))
    finally:
        store.close()


def test_local_files_are_read_once_per_epoch_the_first_too(tmp_path: Path) -> None:
    """Local files (the default window: every row group, so the next epoch's first batches need
    them all and read them all ahead): each epoch counts each row group once."""
    paths = P.write_parquet(tmp_path / "data", [30, 20, 25], 10)
    source = functools.partial(P.id_parquet, urls=str(tmp_path / "data"))
    check_epoch_reads(epoch_reads(source, 3), *requested_chunks(paths))


def test_the_index_command_takes_a_glob_of_parquet_files_without_their_extension(
    tmp_path: Path,
) -> None:
    """``index 'dir/train-*'``: Parquet by what the pattern matches (it looked for tar shards and
    said the matches were other files)."""
    P.write_parquet(tmp_path, (20, 10), 10)
    assert cli(["index", str(tmp_path / "train-*")]) == 0
    summary = json.loads((tmp_path / "loader-parquet-summary.json").read_text())
    assert len(summary["files"]) == 2
