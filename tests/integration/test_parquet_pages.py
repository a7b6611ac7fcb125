"""A large row group cut between workers, and one resumed part way: each worker reads the pages
that hold its rows (the file's page index, as ``datasets`` writes it), not the whole row group;
every row once, with its own bytes, the same stream on the same layout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("datasets")

from loader import Loader, ParquetDataset
from tests import parquet_pipelines as P

pytestmark = pytest.mark.timeout(240)

ROWS = 480


def blob(i: int) -> bytes:
    return bytes([i % 256, (i // 256) % 256]) * (6_000 + 5 * i)


def page_sizes(path: Path) -> tuple[int, int]:
    """The bytes of ``path``'s requested chunks (image, id), and its largest image page."""
    import pyarrow.parquet as pq

    from workers.sources.parquet import _pages as pages
    from workers.sources.parquet import _thrift as thrift

    meta = pq.ParquetFile(path).metadata
    group = meta.row_group(0)
    chunks = sum(
        group.column(k).total_compressed_size
        for k in range(group.num_columns)
        if group.column(k).path_in_schema in ("image.bytes", "image.path", "id")
    )
    data = path.read_bytes()
    footer = pages.decode_footer(data[-8 - int.from_bytes(data[-8:-4], "little") : -8])
    chunk = footer.get_value(4)[1][0].get_value(1)[1][0]  # (image.bytes)
    index, _end = thrift.decode(data, chunk.get_value(4))
    return chunks, max(int(page.get_value(2)) for page in index.get_value(1)[1])


@pytest.fixture(scope="module")
def one_row_group(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One file of one row group written by ``datasets`` (its page index, its image column
    plain and uncompressed), in pages of 32-128 KB (its content-defined chunking, narrowed)."""
    import datasets

    features = datasets.Features({"image": datasets.Image(), "id": datasets.Value("int64")})
    rows = {
        "image": [{"bytes": blob(i), "path": None} for i in range(ROWS)],
        "id": list(range(ROWS)),
    }
    path = tmp_path_factory.mktemp("pages") / "train.parquet"
    datasets.Dataset.from_dict(rows, features=features).to_parquet(
        str(path),
        batch_size=ROWS,
        use_content_defined_chunking={"min_chunk_size": 32 << 10, "max_chunk_size": 128 << 10},
    )
    return path


def loader_over(path: Path, workers: int, shuffle: bool = True) -> Loader:
    dataset = ParquetDataset(str(path), columns=("image", "id"), shuffle=shuffle)
    return Loader(dataset, P.bytes_step, batch_size=8, num_workers=workers, copy=True)


def rows_of(batch: Any) -> list[int]:
    """The batch's ids, each image checked to be its row's own bytes."""
    ids = [int(v) for v in np.asarray(batch["id"]).ravel()]
    ids = ids[: len(ids) - batch.info.padded]
    for i, image in zip(ids, batch["image"], strict=False):
        assert np.asarray(image).tobytes() == blob(i), i
    return ids


@pytest.mark.parametrize("shuffle", [True, False])
def test_workers_sharing_a_row_group_read_their_pages_and_resume_reads_the_pages_owed(
    one_row_group: Path, shuffle: bool
) -> None:
    """Three workers over one 6.9 MB row group: an epoch reads about the requested chunks once
    (not three times: each worker its pages, and two pages at most at each cut); resumed part
    way, the rest of the epoch reads the pages of the rows still owed (unshuffled: the owed
    share of the chunks; shuffled, the owed rows lie across each worker's part: about the
    chunks, where each worker read its whole row group before), the same stream as before; on
    two workers, every row once."""
    chunks, page = page_sizes(one_row_group)
    assert chunks > 4 << 20 and page <= 160 << 10
    ends = 3 * 2 * page + (64 << 10)  # (the pages at each worker's ends; the offset indexes)
    with loader_over(one_row_group, 3, shuffle) as loader:
        epochs, reads = [], []
        for _ in range(2):
            epochs.append([rows_of(batch) for batch in loader])
            reads.append(loader.stats().bytes_read - sum(reads))
    assert sorted(i for ids in epochs[0] for i in ids) == list(range(ROWS))
    assert all(chunks <= nbytes <= chunks + ends for nbytes in reads), reads

    with loader_over(one_row_group, 3, shuffle) as loader:
        iterator = iter(loader)
        taken = [rows_of(next(iterator)) for _ in range(9)]
        state = json.loads(json.dumps(loader.state_dict()))
    owed = ROWS - sum(len(ids) for ids in taken)
    with loader_over(one_row_group, 3, shuffle) as loader:
        loader.load_state_dict(state)
        rest = [rows_of(batch) for batch in loader]
        again = loader.stats().bytes_read
    assert taken + rest == epochs[0]
    assert again <= (chunks if shuffle else chunks * owed / ROWS) + ends, (again, chunks, owed)

    with loader_over(one_row_group, 2, shuffle) as loader:
        loader.load_state_dict(state)
        rest = [rows_of(batch) for batch in loader]
    assert sorted(i for ids in taken + rest for i in ids) == list(range(ROWS))


def test_two_ranks_on_s3_read_the_pages_of_their_share_once(one_row_group: Path) -> None:
    """One large row group on an S3-protocol server behind a counting proxy, two ranks of two
    workers: the ranges read (footer aside; the next epoch's read-ahead reads the same ones)
    add up to the requested chunks once, with the pages at each of the four parts' ends (before:
    every worker's GET of the whole row group, 4x), a few ranged reads a worker (its offset
    indexes, its pages); ``stats()`` counts the same of the epoch."""
    from bench._s3 import CountingProxy, S3Server

    chunks, page = page_sizes(one_row_group)
    server = S3Server(threaded=True)
    proxy = CountingProxy(server.endpoint)
    try:
        server.bucket("pages")
        client = server.client()
        client.upload_file(str(one_row_group), "pages", one_row_group.name)
        client.close()
        dataset = ParquetDataset(
            "s3://pages", columns=("image", "id"), storage_options=server.options(proxy.endpoint)
        )
        seen, counted = [], 0
        for rank in range(2):
            with Loader(
                dataset, P.bytes_step, batch_size=8, num_workers=2, rank=rank, world_size=2
            ) as loader:
                seen += [i for batch in loader for i in rows_of(batch)]
                counted += loader.stats().bytes_read
        served = [s for s in proxy.records() if s.method == "GET" and "bytes=" in s.range]
    finally:
        proxy.close()
        server.close()
    assert sorted(seen) == list(range(ROWS))
    size = one_row_group.stat().st_size
    reads = {s.range: s.bytes for s in served if not s.range.endswith(f"-{size - 1}")}
    ends = 4 * 2 * page + (64 << 10)
    assert chunks <= sum(reads.values()) <= chunks + ends, reads
    assert chunks <= counted <= chunks + ends
    assert all(nbytes < chunks / 2 for nbytes in reads.values())
    assert len(reads) <= 4 * 4, reads


def test_an_offset_index_whose_first_rows_lie_is_not_trusted(
    one_row_group: Path, tmp_path: Path
) -> None:
    """A page index that says a middle page begins a row later than it does (the file still
    well-formed, pyarrow reads it whole): a worker reading its rows by that page gave each of
    its rows the image of the row before, silently. The pages' headers tell their values: the
    row group is read whole instead, every image its own row's."""
    import shutil

    from workers.sources.parquet import _pages as pages
    from workers.sources.parquet import _thrift as thrift

    path = tmp_path / "lies.parquet"
    shutil.copy(one_row_group, path)
    data = bytearray(path.read_bytes())
    footer = pages.decode_footer(bytes(data[-8 - int.from_bytes(data[-8:-4], "little") : -8]))
    chunk = footer.get_value(4)[1][0].get_value(1)[1][0]  # (image.bytes)
    at = chunk.get_value(4)
    index, end = thrift.decode(bytes(data), at)
    locations = index.get_value(1)[1]
    firsts = [int(location.get_value(3)) for location in locations]
    half = ROWS // 2  # (where the second worker's rows begin, unshuffled)
    page = max(k for k, first in enumerate(firsts) if first < half)  # (the page holding it)
    location = locations[page]
    location[3] = (thrift.I64, firsts[page] + 1)  # (a row later than it is)
    encoded = thrift.encode(index)
    assert len(encoded) == end - at  # (the same length: the file stays well-formed)
    data[at:end] = encoded
    path.write_bytes(bytes(data))
    with loader_over(path, 2, shuffle=False) as loader:  # (each worker half the row group)
        seen = [i for batch in loader for i in rows_of(batch)]  # (images checked: their rows')
    assert sorted(seen) == list(range(ROWS))
