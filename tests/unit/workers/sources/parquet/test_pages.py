"""Rows of a row group read from the pages that hold them (a file's page index): the same values
as the whole row group gives, for every kind of column, for far fewer bytes; a file without a
page index, or with one that lies, read whole."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from workers.sources.parquet import _pages as pages  # noqa: E402
from workers.sources.parquet import _thrift as thrift  # noqa: E402
from workers.sources.parquet._plan import open_plan  # noqa: E402
from workers.sources.parquet._reader import ParquetLoader  # noqa: E402

ROWS = 400
COLUMNS = ("image", "caption", "label", "vector", "score")


def every_kind(rows: int = ROWS) -> Any:
    """A table of every column kind the reader gives, nulls among them: an ``Image`` struct
    (bytes, or a path where the bytes are empty), a string, an int (dictionary-encoded by
    default), a list of floats and a float."""
    rng = np.random.default_rng(3)
    image = [
        None
        if i % 37 == 5
        else {"bytes": b"", "path": f"img/{i}.jpg"}
        if i % 41 == 7
        else {"bytes": bytes([i % 256]) * int(rng.integers(50, 900)), "path": None}
        for i in range(rows)
    ]
    return pa.table(
        {
            "image": pa.array(image, pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
            "caption": [None if i % 13 == 0 else f"caption {i} " * (i % 7) for i in range(rows)],
            "label": [i % 5 for i in range(rows)],
            "vector": [[float(i)] * (i % 4) if i % 11 else None for i in range(rows)],
            "score": [i / 3 for i in range(rows)],
        }
    )


def write(path: Path, table: Any, **options: Any) -> Path:
    """``table`` written with a page index, in small pages, uncompressed, and (as ``datasets``
    does for its image columns) no dictionary but the label's: a dictionary page holds every
    value of its chunk, so a dictionary-encoded column's pages save nothing."""
    options.setdefault("use_dictionary", ["label"])
    options.setdefault("write_page_index", True)
    options.setdefault("compression", "none")
    options.setdefault("write_batch_size", 16)  # (a page ends between batches of values)
    options.setdefault("data_page_size", 2048)
    options.setdefault("row_group_size", ROWS)
    pq.write_table(table, path, **options)
    return path


def footer_of(path: Path) -> tuple[bytes, thrift.Struct]:
    data = path.read_bytes()
    (size,) = struct.unpack("<I", data[-8:-4])
    return data, pages.decode_footer(data[-8 - size : -8])


def read_rows(
    path: Path, lo: int, hi: int, columns: tuple[str, ...] = COLUMNS
) -> tuple[list[Any], int]:
    """Columns of rows [lo, hi) of row group 0 read by their pages, and the bytes read."""
    data, footer = footer_of(path)
    leaves = pages.leaves_of(footer, columns)
    assert leaves is not None
    flat = [leaf for group in leaves for leaf in group]
    where = pages.index_range(footer, 0, flat)
    assert where is not None
    parts = pages.pages_for(footer, 0, flat, data[where[0] : where[1]], where[0], lo, hi)
    arrays, read = {}, where[1] - where[0]
    for part in parts:
        dictionary = data[slice(*part.dictionary)] if part.dictionary else b""
        body = data[slice(*part.pages)]
        read += len(dictionary) + len(body)
        made = pages.leaf_file(footer, 0, part, dictionary, body)
        array = pages.read_leaf(pq, pa, made, part.leaf)
        assert len(array) == part.rows[1] - part.rows[0]
        arrays[part.leaf] = array.slice(lo - part.rows[0], hi - lo)
    return [pages.put_together(pa, [arrays[k] for k in group]) for group in leaves], read


@pytest.mark.parametrize("lo,hi", [(0, 1), (0, 57), (123, 190), (250, 400), (399, 400), (0, 400)])
def test_rows_read_by_their_pages_are_the_row_groups_rows(tmp_path: Path, lo: int, hi: int) -> None:
    table = every_kind()
    path = write(tmp_path / "a.parquet", table)
    got, read = read_rows(path, lo, hi)
    for name, array in zip(COLUMNS, got, strict=True):
        assert array.equals(table.column(name).slice(lo, hi - lo).combine_chunks()), name
    if hi - lo < 100:  # (a few pages of the image column, not all of them)
        assert read < 0.5 * path.stat().st_size


def test_a_dictionary_encoded_and_a_compressed_column_read_by_pages(tmp_path: Path) -> None:
    table = pa.table(
        {"label": [i % 7 for i in range(5000)], "text": [f"t{i}" for i in range(5000)]}
    )
    path = write(tmp_path / "a.parquet", table, row_group_size=5000, compression="zstd")
    data, footer = footer_of(path)
    leaves = pages.leaves_of(footer, ("label", "text"))
    assert leaves == [[0], [1]]
    parts = pages.pages_for(footer, 0, [0, 1], data, 0, 2000, 2100)
    assert parts[0].dictionary is not None  # (the label column's dictionary page is read too)
    for part, name in zip(parts, ("label", "text"), strict=True):
        dictionary = data[slice(*part.dictionary)] if part.dictionary else b""
        made = pages.leaf_file(footer, 0, part, dictionary, data[slice(*part.pages)])
        array = pages.read_leaf(pq, pa, made, part.leaf).slice(2000 - part.rows[0], 100)
        assert array.to_pylist() == table.column(name).to_pylist()[2000:2100]


def test_a_footer_is_written_back_byte_for_byte(tmp_path: Path) -> None:
    path = write(tmp_path / "a.parquet", every_kind())
    data, footer = footer_of(path)
    (size,) = struct.unpack("<I", data[-8:-4])
    assert thrift.encode(footer) == data[-8 - size : -8]
    with pytest.raises(ValueError, match="Thrift"):
        thrift.decode(data[-8 - size : -8 - size // 2])


def test_without_a_page_index_or_with_nested_columns_there_is_nothing_to_read_by(
    tmp_path: Path,
) -> None:
    path = write(tmp_path / "a.parquet", every_kind(), write_page_index=False)
    assert pages.leaves_of(footer_of(path)[1], COLUMNS) is None
    nested = pa.table({"a": [{"b": {"c": i, "d": -i}} for i in range(10)]})
    path = write(tmp_path / "b.parquet", nested)
    assert pages.leaves_of(footer_of(path)[1], ("a",)) is None


def big_file(tmp_path: Path) -> Path:
    """One row group of 600 rows of about 10 KB each, in pages of about 64 KB."""
    table = pa.table(
        {
            "blob": [bytes([i % 256]) * (9_000 + 7 * i) for i in range(600)],
            "id": list(range(600)),
        }
    )
    return write(tmp_path / "big.parquet", table, row_group_size=600, data_page_size=64 << 10)


def test_a_worker_needing_part_of_a_large_row_group_reads_its_pages_only(tmp_path: Path) -> None:
    """A worker's part of a row group (rows 200-299): the loader reads the offset indexes and
    the pages holding those rows -- under a fifth of the row group's bytes -- and gives every
    row's own bytes."""
    path = big_file(tmp_path)
    plan = open_plan(str(path), ("blob", "id"))
    size = int(plan.sizes[0])
    assert size > pages.MIN_BYTES
    load = ParquetLoader(plan)
    load.expect(0, [np.arange(200, 250), np.arange(250, 300)])
    for i in range(200, 300):
        blob, ids = load(i)
        assert int(ids[0]) == i and blob.tobytes() == bytes([i % 256]) * (9_000 + 7 * i)
    assert load.bytes_read < 0.2 * size
    assert load.requests <= 3  # (the offset indexes, the blob's pages, the id's page)
    # a row outside what the epoch said it needs: the row group is read whole for it
    blob, ids = load(10)
    assert int(ids[0]) == 10 and blob.tobytes() == bytes([10]) * 9_070
    assert load.bytes_read > size
    # page_index=False: the row group is read whole
    whole = ParquetLoader(plan, page_index=False)
    whole.expect(0, [np.arange(200, 300)])
    assert [int(whole(i)[1][0]) for i in range(200, 300)] == list(range(200, 300))
    assert whole.bytes_read == size and whole.requests == len(plan.ranges[0])


def spoil_offset_index(path: Path) -> None:
    """Rewrite the first page's first row in ``path``'s offset index of its first column (0 ->
    -1, as long in Thrift)."""
    data, footer = footer_of(path)
    chunk = footer.get_value(4)[1][0].get_value(1)[1][0]
    at = chunk.get_value(4)
    index, end = thrift.decode(data, at)
    first = index.get_value(1)[1][0]
    first[3] = (thrift.I64, -1)
    spoilt = thrift.encode(index)
    assert len(spoilt) == end - at
    path.write_bytes(data[:at] + spoilt + data[end:])


def test_an_offset_index_that_lies_is_not_used(tmp_path: Path) -> None:
    """An offset index that does not describe its pages: the row group is read whole, and its
    rows are right."""
    path = big_file(tmp_path)
    spoil_offset_index(path)
    plan = open_plan(str(path), ("blob", "id"))
    load = ParquetLoader(plan)
    load.expect(0, [np.arange(200, 300)])
    assert [int(load(i)[1][0]) for i in range(200, 300)] == list(range(200, 300))
    assert load.bytes_read > plan.sizes[0]


def test_the_bytes_read_ahead_count_the_pages_a_worker_reads_not_the_row_groups(
    tmp_path: Path,
) -> None:
    """Three large row groups of which an epoch needs a sixth each: within ``ahead_bytes`` of
    3 MiB, the third one's pages are read ahead with the second's (about 1.1 MB each), where
    their whole row groups (6.7 MB each) would have kept it waiting; with ``page_index=False``
    it waits."""
    import shutil

    path = big_file(tmp_path)
    for name in ("b", "c"):
        shutil.copy(path, tmp_path / f"{name}.parquet")
    plan = open_plan(str(tmp_path), ("blob", "id"))
    assert len(plan.counts) == 3 and int(plan.sizes[0]) > 5 << 20
    batches = [np.arange(600 * k, 600 * k + 100) for k in range(3)]
    for page_index in (True, False):
        load = ParquetLoader(plan, ahead=2, ahead_bytes=3 << 20, page_index=page_index)
        load.expect(0, batches)
        assert (load._ahead.get(2) is not None) == page_index
        assert [int(load(int(i))[1][0]) for i in batches[0][:3]] == [0, 1, 2]


def test_a_column_named_as_another_columns_leaf_is_read_by_its_own_pages(tmp_path: Path) -> None:
    """A top-level ``a.b`` beside a struct ``a{b}``: both leaves have the dotted path ``a.b``,
    which selected both (a damaged row group); a leaf is read by its number."""
    table = pa.table(
        {
            "a.b": pa.array(range(ROWS), pa.int64()),
            "a": pa.array([{"b": -i} for i in range(ROWS)]),
        }
    )
    path = write(tmp_path / "a.parquet", table)
    (dotted,), _read = read_rows(path, 10, 30, ("a.b",))
    assert dotted.to_pylist() == list(range(10, 30))
    (struct,), _read = read_rows(path, 10, 30, ("a",))
    assert struct.field(0).to_pylist() == [-i for i in range(10, 30)]
