"""Column kinds and values: each Arrow type the reader gives, refused types named."""

from __future__ import annotations

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")

from workers.sources.parquet._columns import (  # noqa: E402
    ColumnKind,
    Values,
    column_kinds,
    default_value,
    hf_features,
)


def test_kinds_of_the_types_it_reads_and_the_hf_metadata() -> None:
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema(
        [
            ("image", image),
            ("label", pa.int8()),
            ("score", pa.float64()),
            ("text", pa.large_string()),
            ("vec", pa.list_(pa.float32())),
            ("raw", pa.binary()),
        ],
        metadata={b"huggingface": b'{"info": {"features": {"image": {"_type": "Image"}}}}'},
    )
    names = ("image", "label", "score", "text", "vec", "raw")
    kinds = [k.kind for k in column_kinds(schema, names, "f.parquet")]
    assert kinds == ["image", "int", "float", "string", "list", "binary"]
    assert hf_features(schema) == {"image": {"_type": "Image"}}


def test_a_missing_column_and_a_type_it_does_not_read_are_named() -> None:
    schema = pa.schema([("image", pa.binary()), ("when", pa.timestamp("s"))])
    with pytest.raises(
        ValueError, match=r"f\.parquet has no column 'label'; its columns: image, when"
    ):
        column_kinds(schema, ("image", "label"), "f.parquet")
    with pytest.raises(ValueError, match=r"column 'when' of f\.parquet has the type timestamp"):
        column_kinds(schema, ("when",), "f.parquet")


def test_values_are_views_of_the_buffers_and_nulls_are_none() -> None:
    data = pa.array([b"ab", b"", None, b"xyz"], pa.binary())
    values = Values("binary", data.slice(1))  # (an offset into the buffers)
    assert values.row(0).tobytes() == b""
    assert values.row(1) is None
    row = values.row(2)
    assert row.tobytes() == b"xyz" and not row.flags.owndata  # a view, no copy
    image = pa.StructArray.from_arrays(
        [pa.array([b"\xff\xd8", b""]), pa.array([None, "pics/a.jpg"])], names=["bytes", "path"]
    )
    images = Values("image", image)
    assert images.row(0).tobytes() == b"\xff\xd8" and images.row(1) == "pics/a.jpg"
    ints = Values("int", pa.array([3, 4], pa.int16()))
    assert ints.row(1).dtype == np.int64 and ints.row(1).tolist() == [4]
    floats = Values("float", pa.array([0.5], pa.float64()))
    assert floats.row(0).dtype == np.float32
    lists = Values("list", pa.array([[1.0, 2.0], [], [3.0]], pa.list_(pa.float64())))
    assert lists.row(0).tolist() == [1.0, 2.0] and lists.row(2).dtype == np.float32
    assert Values("string", pa.array(["héllo"])).row(0).tobytes() == "héllo".encode()


def test_an_optional_default_is_the_array_a_value_of_its_column_gives() -> None:
    def made(kind: str, type_: str, value: object) -> np.ndarray:
        return default_value(ColumnKind("c", kind, type_), value)

    assert made("string", "string", "café").tobytes() == "café".encode()
    assert made("binary", "binary", b"").dtype == np.uint8 and made("image", "x", b"").size == 0
    assert made("int", "int8", 7).tolist() == [7] and made("int", "int8", 7).dtype == np.int64
    assert made("float", "double", 0.5).dtype == np.float32
    assert made("list", "list<item: float>", []).dtype == np.float32
    assert made("list", "list<item: int32>", [1, 2]).tolist() == [1, 2]
    with pytest.raises(TypeError, match=r"optional\['c'\] must be an int \(column 'c' is int8\)"):
        made("int", "int8", "seven")
    with pytest.raises(TypeError, match=r"must be bytes or a str"):
        made("string", "string", 3)
    with pytest.raises(TypeError, match=r"must be a number"):
        made("float", "float", True)


@pytest.mark.parametrize(
    "arrow_type",
    [
        pa.int8(),
        pa.uint8(),
        pa.int32(),
        pa.uint64(),
        pa.int64(),
        pa.bool_(),
        pa.float16(),
        pa.float64(),
    ],
)
def test_numbers_of_every_width_sliced_with_nulls_are_read_from_the_buffers(
    arrow_type: object,
) -> None:
    """Each row's value (a null: None) equals pyarrow's own, through a slice's offset."""
    raw = [1, None, 0, 3, None, 2, 1, 0, 3, 2, 1]
    given = [None if v is None else (bool(v % 2) if arrow_type == pa.bool_() else v) for v in raw]
    column = pa.array(given, type=arrow_type).slice(3, 7)
    kind = "float" if pa.types.is_floating(column.type) else "int"
    values = Values(kind, column)
    expected = column.to_pylist()
    for row, value in enumerate(expected):
        got = values.row(row)
        if value is None:
            assert got is None
        else:
            assert got is not None and float(got[0]) == float(value)


def test_lists_sliced_and_with_a_null_backed_by_values_keep_each_rows_values() -> None:
    """A null list whose offsets still cover values (as a filter leaves it) shifts no later
    row; a slice's offset counts, in variable, large and fixed-size lists."""
    values = pa.array([1, 2, 3, 4, 5, 6, 7, 8, 9], type=pa.int16())
    offsets = pa.array([0, 2, 4, 7, 9], type=pa.int32())
    mask = pa.array([False, True, False, False])
    listed = pa.ListArray.from_arrays(offsets, values, mask=mask).slice(1, 3)
    got = Values("list", listed)
    assert got.row(0) is None
    assert got.row(1).tolist() == [5, 6, 7]
    assert got.row(2).tolist() == [8, 9]
    large = pa.array([[1.5], [2.5, 3.5], [4.5]], type=pa.large_list(pa.float64())).slice(1)
    assert Values("list", large).row(0).tolist() == [2.5, 3.5]
    assert Values("list", large).row(0).dtype == np.float32
    fixed = pa.array([[1, 2], [3, 4], [5, 6]], type=pa.list_(pa.int32(), 2)).slice(1, 2)
    assert [Values("list", fixed).row(k).tolist() for k in (0, 1)] == [[3, 4], [5, 6]]


def test_reading_a_row_group_imports_no_pandas(tmp_path: object) -> None:
    """pyarrow's ``to_numpy``/``fill_null`` import pandas (0.18 s in each worker before its
    first batch): the values of every kind are read without them."""
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    import pyarrow.parquet as pq

    path = Path(str(tmp_path)) / "t.parquet"
    image = pa.array(
        [{"bytes": b"\xff\xd8", "path": None}, {"bytes": None, "path": "a.jpg"}],
        type=pa.struct([("bytes", pa.binary()), ("path", pa.string())]),
    )
    table = pa.table(
        {
            "image": image,
            "label": pa.array([1, None], pa.int64()),
            "flag": pa.array([True, None]),
            "score": pa.array([0.5, None], pa.float32()),
            "vec": pa.array([[1, 2], None], pa.list_(pa.int64())),
            "text": pa.array(["a", None]),
        }
    )
    pq.write_table(table, path)
    script = textwrap.dedent(
        f"""
        import sys
        import pyarrow.parquet as pq
        from workers.sources.parquet._columns import column_kinds, values_of
        file = pq.ParquetFile({str(path)!r})
        names = tuple(file.schema_arrow.names)
        kinds = column_kinds(file.schema_arrow, names, "t.parquet")
        columns = values_of(kinds, file.read_row_group(0, columns=list(names)))
        print([repr(c.row(1)) for c in columns], "pandas" in sys.modules)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("]")[-1].strip() == "False", done.stdout
    assert "'a.jpg'" in done.stdout and done.stdout.count("None") >= 4


def test_values_that_do_not_fit_or_nulls_inside_lists_are_never_given_as_other_values() -> None:
    """A uint64 past int64's largest came as a negative int64, a null inside a list of numbers
    as 0: now a float list's null is NaN, and a row that cannot be given as it is raises,
    naming the column (a bad sample: skipped with its accounting under on_error="skip")."""
    big = Values("int", pa.array([1, 2**63, 2**64 - 1, 7], pa.uint64()), "u64")
    assert big.row(0).tolist() == [1] and big.row(3).tolist() == [7]
    for row in (1, 2):
        with pytest.raises(ValueError, match=r"column 'u64' holds a uint64 past int64's"):
            big.row(row)
    listed = Values("list", pa.array([[1, 2**64 - 1], [3]], pa.list_(pa.uint64())), "ul")
    with pytest.raises(ValueError, match=r"column 'ul' holds a uint64 past int64's"):
        listed.row(0)
    assert listed.row(1).tolist() == [3]
    floats = Values("list", pa.array([[1.5, None, 2.0], [None], [3.0]], pa.list_(pa.float32())))
    assert np.isnan(floats.row(0)[1]) and floats.row(0)[[0, 2]].tolist() == [1.5, 2.0]
    assert np.isnan(floats.row(1)).all() and floats.row(2).tolist() == [3.0]
    ints = Values("list", pa.array([[1, None, 3], [4], None, [None]], pa.list_(pa.int64())), "li")
    with pytest.raises(ValueError, match=r"column 'li' holds a null inside its list"):
        ints.row(0)
    assert ints.row(1).tolist() == [4] and ints.row(2) is None  # (a null row: as before)
    with pytest.raises(ValueError, match=r"holds a null inside its list"):
        ints.row(3)
