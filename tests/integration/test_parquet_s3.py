"""sharded_parquet over an object store: Parquet written by Hugging Face ``datasets``, served by a
real S3-protocol server (moto's, on 127.0.0.1) behind a proxy that counts every request and its
bytes; real s3fs in the workers."""

from __future__ import annotations

import functools
import json
import uuid
from collections import Counter
from collections.abc import Iterator
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
from tests import parquet_pipelines as P

pytestmark = pytest.mark.timeout(300)

#: 100-row row groups over files of uneven sizes (row groups 100, 100, 50 | 100, 30 | 40)
SIZES = (250, 130, 40)
TOTAL = sum(SIZES)
COLUMNS = ("image", "label", "id")


class Counted:
    """A server with a bucket of its own (so that no test finds another's footers in the
    session's cache) and a counting proxy in front of it."""

    def __init__(self) -> None:
        from bench._s3 import CountingProxy, S3Server

        self.server = S3Server(threaded=True)
        self.proxy = CountingProxy(self.server.endpoint)
        self.bucket = f"parquet-{uuid.uuid4().hex[:12]}"
        self.server.bucket(self.bucket)

    def upload(self, paths: list[Path]) -> None:
        client = self.server.client()
        try:
            for path in paths:
                client.upload_file(str(path), self.bucket, path.name)
        finally:
            client.close()

    def loader(self, workers: int = 2, rank: int = 0, world_size: int = 1) -> Loader:
        source = functools.partial(
            P.image_parquet,
            urls=f"s3://{self.bucket}",
            storage_options=self.server.options(self.proxy.endpoint),
        )
        return Loader(
            source,
            P.decode_step,
            batch_size=4,
            num_workers=workers,
            rank=rank,
            world_size=world_size,
            copy=True,
        )

    def close(self) -> None:
        self.proxy.close()
        self.server.close()


@pytest.fixture
def counted(tmp_path: Path) -> Iterator[tuple[Counted, list[Path]]]:
    made = Counted()
    try:
        paths = P.write_parquet(tmp_path / "data", SIZES, 100)
        made.upload(paths)
        yield made, paths
    finally:
        made.close()


def ids(batch: Any) -> list[int]:
    values = [int(v) for v in np.asarray(batch["id"]).ravel()]
    return values[: len(values) - batch.info.padded]


class Units:
    """The row groups of the files: each one's byte range (of the requested columns, as one
    ranged read fetches it), its rows' ids and its columns' chunk bytes."""

    def __init__(self, paths: list[Path]) -> None:
        import pyarrow.parquet as pq

        self.sizes = {path.name: path.stat().st_size for path in paths}
        self.ranges: dict[tuple[str, int, int], tuple[int, int]] = {}  # -> first id, rows
        self.chunks = 0
        first = 0
        for path in paths:
            meta = pq.ParquetFile(path).metadata
            for group in range(meta.num_row_groups):
                row_group = meta.row_group(group)
                spans = []
                for k in range(row_group.num_columns):
                    column = row_group.column(k)
                    start = column.data_page_offset
                    if column.has_dictionary_page and column.dictionary_page_offset:
                        start = min(start, column.dictionary_page_offset)
                    spans.append((start, start + column.total_compressed_size))
                    self.chunks += column.total_compressed_size
                begin, end = min(s for s, _ in spans), max(e for _, e in spans)
                self.ranges[(path.name, begin, end)] = (first, row_group.num_rows)
                first += row_group.num_rows

    def of(self, served: Any) -> tuple[str, int, int] | None:
        """The row group a served GET read, None when it read something else (a footer)."""
        if served.method != "GET" or not served.range.startswith("bytes="):
            return None
        start, _, last = served.range[len("bytes=") :].partition("-")
        key = (served.name, int(start), int(last) + 1)
        return key if key in self.ranges else None

    def is_footer(self, served: Any) -> bool:
        if served.method != "GET" or not served.range.startswith("bytes="):
            return False
        return int(served.range.rsplit("-", 1)[-1]) + 1 == self.sizes.get(served.name)


def test_every_row_once_per_epoch_on_two_ranks_footers_once_for_the_node(
    counted: tuple[Counted, list[Path]],
) -> None:
    store, paths = counted
    units = Units(paths)
    store.proxy.reset()
    seen: list[int] = []
    loaders = [store.loader(2, rank, 2) for rank in range(2)]
    try:
        assert len(loaders[0]) == len(loaders[1])
        iterators = [iter(loader) for loader in loaders]
        for iterator in iterators:
            seen += ids(next(iterator))
        before = store.proxy.records()
        for iterator in iterators:
            seen += [i for batch in iterator for i in ids(batch)]
    finally:
        for loader in loaders:
            loader.close()
    assert sorted(seen) == list(range(TOTAL))
    # before the first batches of 2 ranks of 2 workers: per rank one look for the summary (none
    # here) and one listing, each footer read once (for the node, not per worker or rank), then
    # each worker's first row groups (and a few ahead)
    footers = [s for s in before if units.is_footer(s)]
    assert sorted(s.name for s in footers) == sorted(units.sizes), before
    groups = [s for s in before if units.of(s) is not None]
    others = [s for s in before if s not in footers and s not in groups]
    assert len(others) <= 4, others
    assert len(before) <= len(paths) + 4 * 3 + 4, before
    # no rank reads a row group twice in the epoch, nor one it does not need
    reads = [units.of(s) for s in store.proxy.records() if units.of(s) is not None]
    assert set(reads) == set(units.ranges)


def test_an_epoch_reads_the_columns_chunks_once_and_a_resume_at_most_a_row_group_a_worker(
    counted: tuple[Counted, list[Path]],
) -> None:
    store, paths = counted
    units = Units(paths)
    with store.loader() as loader:
        iterator = iter(loader)
        first = ids(next(iterator))
        store.proxy.reset()  # (after the start: the footers and the first row groups)
        rest = [i for batch in iterator for i in ids(batch)]
        served = store.proxy.records()
    assert sorted(first + rest) == list(range(TOTAL))
    reads = [(units.of(s), s.bytes) for s in served if units.of(s) is not None]
    # (the start's reads were not counted; the next epoch's first may be: fetched ahead)
    assert len(reads) <= len(units.ranges) + 2 * 3, reads
    by_unit: dict[Any, int] = {}
    for unit, size in reads:
        by_unit.setdefault(unit, size)
    everything = sum(s.bytes for s in served)
    assert sum(by_unit.values()) <= 1.05 * units.chunks
    assert everything <= 1.05 * units.chunks + 2 * 3 * max(end - b for _n, b, end in units.ranges)
    assert not [s for s in served if units.is_footer(s)]  # (footers: read at the start only)

    with store.loader() as loader:
        iterator = iter(loader)
        taken = [i for _ in range(5) for i in ids(next(iterator))]
        state = json.loads(json.dumps(loader.state_dict()))
    store.proxy.reset()
    with store.loader() as loader:
        loader.load_state_dict(state)
        iterator = iter(loader)
        resumed = [i for _ in range(4) for i in ids(next(iterator))]
        early = store.proxy.records()  # (far from the epoch's end: nothing of the next one)
        resumed += [i for batch in iterator for i in ids(batch)]
    assert sorted(taken + resumed) == list(range(TOTAL))
    delivered = {
        key
        for key, (start, rows) in units.ranges.items()
        if any(start <= i < start + rows for i in taken)
    }
    again = {units.of(s) for s in early} & delivered
    # each of 2 workers was part way through one row group: only those are read again
    assert 1 <= len(again) <= 2, (again, delivered)


def test_an_object_cut_short_after_the_plan_is_named_as_changed(
    counted: tuple[Counted, list[Path]],
) -> None:
    """A file replaced in the bucket by a few bytes of it once the job has planned: the next
    ranged read lies past its new end and the store refuses it (416, no identity told); the
    error says the object changed since the job planned, not only that a range failed."""
    store, paths = counted
    with store.loader(workers=1) as loader:
        batches = iter(loader)
        next(batches)
        client = store.server.client()
        try:
            for path in paths:
                client.put_object(Bucket=store.bucket, Key=path.name, Body=path.read_bytes()[:64])
        finally:
            client.close()
        with pytest.raises(Exception, match=r"changed since the job planned its epochs") as raised:
            for _batch in batches:
                pass
    assert "-> 64 bytes, ETag:" in str(raised.value)


def test_an_object_named_alone_or_with_a_globs_characters_is_read_as_itself(
    counted: tuple[Counted, list[Path]],
) -> None:
    """A file's own URL lists the file itself on S3 (it was taken for a directory and its name
    added to it: ``one.parquet/one.parquet does not exist``); a key or prefix whose name holds
    ``?`` or ``[`` is that object, not a glob's matches."""
    made, paths = counted
    client = made.server.client()
    try:
        client.upload_file(str(paths[2]), made.bucket, "odd/[v2].parquet")
        client.upload_file(str(paths[2]), made.bucket, "i?j/part.parquet")
    finally:
        client.close()
    bucket = f"s3://{made.bucket}"
    urls = [f"{bucket}/{paths[0].name}", f"{bucket}/odd/[v2].parquet", f"{bucket}/i?j"]
    source = functools.partial(P.image_parquet, urls=urls, storage_options=made.server.options())
    with Loader(source, P.decode_step, batch_size=4, num_workers=2, copy=True) as loader:
        got = Counter(i for batch in loader for i in ids(batch))
    last = range(TOTAL - SIZES[2], TOTAL)  # (the third file's rows, under two names)
    assert got == Counter({**dict.fromkeys(range(SIZES[0]), 1), **dict.fromkeys(last, 2)})
