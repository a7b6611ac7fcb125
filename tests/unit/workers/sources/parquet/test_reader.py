"""ParquetLoader: a row group read with one ranged read of the requested columns only, rows
served from it, reads ahead planned from an epoch's batches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from workers.sources.parquet._plan import open_plan  # noqa: E402
from workers.sources.parquet._reader import ParquetLoader, SparseFile  # noqa: E402
from workers.sources.plan import Defaulted  # noqa: E402
from workers.sources.storage import reads_so_far  # noqa: E402


def test_rows_come_from_one_read_per_row_group_of_the_requested_columns(tmp_path: Path) -> None:
    rows = 30
    table = pa.table(
        {
            "big": [bytes([i]) * 5000 for i in range(rows)],  # (never read)
            "id": list(range(rows)),
            "blob": [bytes([i]) * 3 for i in range(rows)],
        }
    )
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=10)
    plan = open_plan(str(tmp_path / "a.parquet"), ("id", "blob"))
    load = ParquetLoader(plan)
    assert [int(load(i)[0][0]) for i in range(rows)] == list(range(rows))
    assert load(17)[1].tobytes() == bytes([17]) * 3
    assert load.requests == 3  # (one per row group: the last two kept)
    assert load.bytes_read == int(plan.sizes.sum()) == int((plan.ends - plan.begins).sum())
    assert load.bytes_read < 10_000
    assert load.describe(17).endswith("a.parquet, row group 1, row 7")


def chunk_bytes(path: Path, names: tuple[str, ...]) -> int:
    """The bytes of the column chunks of ``names`` in every row group of ``path``."""
    meta = pq.ParquetFile(path).metadata
    total = 0
    for group in range(meta.num_row_groups):
        for k in range(meta.num_columns):
            column = meta.row_group(group).column(k)
            if column.path_in_schema in names:
                total += column.total_compressed_size
    return total


def test_columns_apart_are_read_apart_not_through_the_columns_between(tmp_path: Path) -> None:
    """``id`` and ``label`` with a large column between them: two ranged reads per row group,
    the large column never read (before: one read from ``id``'s chunk to ``label``'s, 20x the
    bytes asked for); the bytes read stay within 1.05x the requested chunks."""
    rows = 30
    table = pa.table(
        {
            "id": list(range(rows)),
            "text": [bytes([i]) * 4000 for i in range(rows)],
            "label": [i % 3 for i in range(rows)],
        }
    )
    path = tmp_path / "a.parquet"
    pq.write_table(table, path, row_group_size=10, compression="none")
    plan = open_plan(str(path), ("id", "label"))
    assert [len(pieces) for pieces in plan.ranges] == [2, 2, 2]
    load = ParquetLoader(plan)
    assert [(int(load(i)[0][0]), int(load(i)[1][0])) for i in range(rows)] == [
        (i, i % 3) for i in range(rows)
    ]
    assert load.requests == 6  # (two per row group)
    wanted = chunk_bytes(path, ("id", "label"))
    assert wanted <= load.bytes_read <= 1.05 * wanted < 10_000
    before = reads_so_far()
    ParquetLoader(plan)(0)
    row_groups, requests, _bytes = (a - b for a, b in zip(reads_so_far(), before, strict=True))
    assert (row_groups, requests) == (1, 2)  # (one row group, read in two ranges)


def test_expected_batches_are_read_ahead_and_dropped_once_passed(tmp_path: Path) -> None:
    pq.write_table(pa.table({"id": list(range(40))}), tmp_path / "a.parquet", row_group_size=10)
    load = ParquetLoader(open_plan(str(tmp_path / "a.parquet"), ("id",)), ahead=1)
    batches = [np.array([0, 1]), np.array([12, 2]), np.array([25, 35])]
    load.expect(0, batches)
    for step, batch in enumerate(batches):
        assert [int(load(int(i))[0][0]) for i in batch] == batch.tolist()
        load.passed(0, step)
    assert load.requests == 4


def test_reads_ahead_for_the_next_epoch_are_counted_with_that_epoch(tmp_path: Path) -> None:
    """A batch of epoch e reports the reads made for epochs up to e (``reads_so_far(e)``): the
    next epoch's row groups read ahead are not counted as the epoch before reading them again."""
    pq.write_table(pa.table({"id": list(range(40))}), tmp_path / "a.parquet", row_group_size=10)
    plan = open_plan(str(tmp_path / "a.parquet"), ("id",))
    load = ParquetLoader(plan, ahead=4)
    size = int((plan.ends - plan.begins).sum())
    batches = [np.array([0, 11]), np.array([22, 33])]
    start = reads_so_far()
    for epoch in (0, 1):
        load.expect(epoch, batches)
        for step, batch in enumerate(batches):
            assert [int(load(int(i))[0][0]) for i in batch] == batch.tolist()
            load.passed(epoch, step)
        assert load.requests == 4 * (epoch + 1)  # (every row group read, once per epoch)
    # (epoch 1's reads were made while epoch 0's batches were still being delivered)
    units, requests, nbytes = reads_so_far(0)
    assert (units - start[0], requests - start[1], nbytes - start[2]) == (4, 4, size)
    units, requests, _nbytes = reads_so_far(1)
    assert (units - start[0], requests - start[1]) == (8, 8)
    assert reads_so_far(0)[0] - start[0] == 8  # (never fewer than reported before)


def test_a_sparse_file_names_a_read_outside_what_it_holds() -> None:
    sparse = SparseFile("f.parquet", 100, {10: np.arange(20, dtype=np.uint8)})
    sparse.seek(12)
    assert sparse.read(3) == bytes([2, 3, 4])
    sparse.seek(50)
    with pytest.raises(OSError, match=r"f\.parquet: bytes 50-52 were not read"):
        sparse.read(2)


def test_a_null_in_an_optional_column_gives_its_default_and_says_so(tmp_path: Path) -> None:
    captions = ["a", None, "c", None]
    table = pa.table({"caption": captions, "score": [1.0, 2.0, None, 4.0]})
    pq.write_table(table, tmp_path / "a.parquet")
    plan = open_plan(str(tmp_path / "a.parquet"), ("caption", "score"))
    load = ParquetLoader(plan, optional={"caption": "-"})
    first, second = load(0), load(1)
    assert not isinstance(first, Defaulted) and first[0].tobytes() == b"a"
    assert isinstance(second, Defaulted) and second.members == ("caption",)
    assert second[0].tobytes() == b"-" and second[1].tolist() == [2.0]
    with pytest.raises(ValueError, match=r"row 2: column 'score' is null; .*optional=\{'score'"):
        load(2)  # (a required column)
    with pytest.raises(ValueError, match=r"optional names 'text', which is not among columns="):
        ParquetLoader(plan, optional={"text": b""})


def test_a_large_row_group_is_read_in_record_batches_with_every_rows_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row group past ``BATCH_BYTES`` is decoded in record batches (its columns never put
    together into one buffer): each row still gives its own values, nulls and lists too."""
    from workers.sources.parquet import _sparse
    from workers.sources.parquet._columns import ChunkedValues

    rows = 50
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.table(
        {
            "image": pa.array(
                [{"bytes": bytes([i]) * (1000 + i), "path": None} for i in range(rows)], image
            ),
            "label": pa.array([None if i % 7 == 3 else i for i in range(rows)], pa.int16()),
            "vec": pa.array([[float(i)] * (i % 4) for i in range(rows)], pa.list_(pa.float32())),
        }
    )
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=rows)
    monkeypatch.setattr(_sparse, "BATCH_BYTES", 8_000)  # (about 8 rows a batch)
    plan = open_plan(str(tmp_path / "a.parquet"), ("image", "label", "vec"))
    load = ParquetLoader(plan, optional={"label": -1})
    for i in reversed(range(rows)):
        got = load(i)
        assert got[0].tobytes() == bytes([i]) * (1000 + i)
        assert got[1].tolist() == [-1 if i % 7 == 3 else i]
        assert got[2].tolist() == [float(i)] * (i % 4)
    held = load._read_unit(0, None)
    assert isinstance(held.values[0], ChunkedValues) and len(held.values[0].chunks) > 4
    assert load.requests == 2  # (the row group read once, and once more just above)


def test_a_sparse_file_gives_pyarrow_views_of_its_pieces_not_copies() -> None:
    piece = np.arange(20, dtype=np.uint8)
    sparse = SparseFile("f.parquet", 100, {10: piece})
    sparse.seek(12)
    view = sparse.read(3)
    piece[3] = 99  # (the view sees it: no copy was made)
    assert bytes(view) == bytes([2, 99, 4])


def test_column_chunks_with_a_few_bytes_between_them_are_read_each_by_its_range(
    tmp_path: Path,
) -> None:
    """Chunks apart by more than the gap read through but less than pyarrow's pre-buffering
    reads through (polars leaves such gaps between the chunks it writes): every row was
    refused as a damaged row group, the bytes between never read."""
    rows = 20
    table = pa.table(
        {
            "a": list(range(rows)),
            "between": [bytes([i]) * 150 for i in range(rows)],  # (a gap of ~3 KB)
            "b": [bytes([i]) * 4 for i in range(rows)],
        }
    )
    pq.write_table(table, tmp_path / "a.parquet", compression="none")
    plan = open_plan(str(tmp_path / "a.parquet"), ("a", "b"))
    assert len(plan.ranges[0]) == 2  # (read apart)
    load = ParquetLoader(plan)
    assert [(int(load(i)[0][0]), load(i)[1].tobytes()) for i in range(rows)] == [
        (i, bytes([i]) * 4) for i in range(rows)
    ]


def test_names_with_dots_uuids_categories_and_widths_that_differ_between_files(
    tmp_path: Path,
) -> None:
    """Columns as other writers write them: a name holding a dot (its chunk was taken for a
    struct's leaf), a UUID (read as an extension type: it failed as a damaged row group), a
    pandas category of strings (refused), an int32 in one file and an int64 in another, and
    binary beside large_binary (refused as other types)."""
    import uuid

    rows = 6
    first = pa.table(
        {
            "label.v1": pa.array(range(rows), pa.int32()),
            "key": pa.array([uuid.UUID(int=i).bytes for i in range(rows)], pa.uuid()),
            "kind": pa.array([f"c{i % 2}" for i in range(rows)]).dictionary_encode(),
            "raw": pa.array([bytes([i]) for i in range(rows)], pa.binary()),
        }
    )
    pq.write_table(first, tmp_path / "a.parquet", store_schema=False)
    second = first.set_column(0, "label.v1", pa.array(range(rows, 2 * rows), pa.int64()))
    second = second.set_column(3, "raw", pa.array([b"x"] * rows, pa.large_binary()))
    pq.write_table(second, tmp_path / "b.parquet")
    plan = open_plan(str(tmp_path), ("label.v1", "key", "kind", "raw"))
    load = ParquetLoader(plan)
    for i in range(2 * rows):
        label, key, kind, raw = load(i)
        assert label.tolist() == [i]
        assert key.tobytes() == uuid.UUID(int=i % rows).bytes
        assert kind.tobytes() == f"c{i % rows % 2}".encode()
        assert raw.tobytes() == (bytes([i]) if i < rows else b"x")


def test_a_column_named_as_another_columns_leaf_is_read_not_taken_for_damage(
    tmp_path: Path,
) -> None:
    """``a.b`` beside a struct ``a{b}``: selected by name, both leaves (path ``a.b``) were read,
    the struct's outside the bytes fetched: "damaged"."""
    table = pa.table({"a.b": [100, 101], "a": pa.array([{"b": 200}, {"b": 201}]), "id": [0, 1]})
    pq.write_table(table, tmp_path / "a.parquet")
    load = ParquetLoader(open_plan(str(tmp_path / "a.parquet"), ("id", "a.b")))
    assert [[v.tolist() for v in load(i)] for i in range(2)] == [[[0], [100]], [[1], [101]]]


def test_a_double_float32_cannot_hold_fails_its_row_naming_where_it_is(tmp_path: Path) -> None:
    import warnings

    pq.write_table(pa.table({"score": [1.5, 1e300, -2.0]}), tmp_path / "a.parquet")
    load = ParquetLoader(open_plan(str(tmp_path / "a.parquet"), ("score",)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no numpy overflow warning on the way)
        assert load(0)[0].tolist() == [1.5] and load(2)[0].tolist() == [-2.0]
        with pytest.raises(
            ValueError, match=r"a\.parquet, row group 0, row 1: column 'score' holds a float past"
        ):
            load(1)
