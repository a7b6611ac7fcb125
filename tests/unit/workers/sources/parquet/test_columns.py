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
