"""What each requested Parquet column becomes: its kind, checked once at the start, and its values
as numpy arrays without a Python object per row. Runs in the worker.

A column's kind comes from its Arrow type, and from the file's ``huggingface`` schema metadata
where present (``datasets`` writes its ``Features`` there: an ``Image`` feature is a
``struct<bytes, path>`` column, a ``ClassLabel`` an integer one):

* ``image``: Hugging Face's ``Image`` (``struct<bytes: binary, path: string>``): the encoded bytes
  (or, where ``bytes`` is null or empty, those of the file at ``path``: read by the reader).
* ``binary``: ``binary``/``large_binary``/``fixed_size_binary``: the bytes.
* ``int``: any integer type (``ClassLabel`` included): int64. ``bool`` too.
* ``float``: any floating type: float32.
* ``string``: ``string``/``large_string``: its UTF-8 bytes.
* ``list``: a fixed or variable list of numbers: a 1-d array of its values' dtype (floats as
  float32, integers as int64).

Anything else (nested structs, maps, lists of strings, dates...) is refused at the start,
naming the column and its type. An optional column's default (``optional={"caption": b""}``) is
made once, at the start, into the array a value of its kind gives (:func:`default_value`).

The values of a read row group are held as numpy views of Arrow's buffers (:class:`Values`): a
row's bytes are one slice of the data buffer between two offsets, never a ``to_pylist()``.
"""

from __future__ import annotations

import bisect
import itertools
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["ColumnKind", "Values", "column_kinds", "default_value", "hf_features", "values_of"]

#: The kinds a column may have (see the module docstring).
KINDS = ("image", "binary", "int", "float", "string", "list")


@dataclass(frozen=True)
class ColumnKind:
    """One requested column: its name, its kind and its Arrow type (as text, for the
    fingerprint and for messages)."""

    name: str
    kind: str
    type: str


def hf_features(schema: Any) -> dict[str, Any]:
    """The ``features`` of the ``huggingface`` schema metadata (``{}`` when there is none or it
    cannot be read)."""
    metadata = schema.metadata or {}
    text = metadata.get(b"huggingface")
    if not text:
        return {}
    try:
        found = json.loads(text)
        features = found.get("info", {}).get("features", {})
    except (ValueError, AttributeError):
        return {}
    return features if isinstance(features, dict) else {}


def _kind(arrow_type: Any, feature: Any) -> str | None:
    """The kind of a column of ``arrow_type`` (``feature``: its ``huggingface`` feature, or
    None); None when it has none the reader gives."""
    import pyarrow as pa

    types = pa.types
    if isinstance(arrow_type, pa.BaseExtensionType):  # (a UUID: its 16 bytes, as its storage)
        return _kind(arrow_type.storage_type, feature)
    if pa.types.is_dictionary(arrow_type):  # (pandas' category, polars' Categorical)
        found = _kind(arrow_type.value_type, feature)
        return found if found in ("int", "float", "string", "binary") else None
    declared = feature.get("_type") if isinstance(feature, dict) else None
    if types.is_struct(arrow_type):
        names = {arrow_type.field(k).name for k in range(arrow_type.num_fields)}
        if "bytes" in names and (declared == "Image" or names <= {"bytes", "path"}):
            inner = arrow_type.field("bytes").type
            if types.is_binary(inner) or types.is_large_binary(inner):
                return "image"
        return None
    if types.is_binary(arrow_type) or types.is_large_binary(arrow_type):
        return "binary"
    if types.is_fixed_size_binary(arrow_type):
        return "binary"
    if types.is_integer(arrow_type) or types.is_boolean(arrow_type):
        return "int"
    if types.is_floating(arrow_type):
        return "float"
    if types.is_string(arrow_type) or types.is_large_string(arrow_type):
        return "string"
    listed = (types.is_list, types.is_large_list, types.is_fixed_size_list)
    if not any(is_list(arrow_type) for is_list in listed):
        return None
    inner = arrow_type.value_type
    if types.is_integer(inner) or types.is_floating(inner) or types.is_boolean(inner):
        return "list"
    return None


def column_kinds(schema: Any, columns: tuple[str, ...], url: str) -> list[ColumnKind]:
    """The kind of each of ``columns`` in ``schema`` (an Arrow schema, of the file at ``url``):
    ``ValueError`` naming the file, the column and the columns it has when one is missing, and
    the column and its type when the reader cannot give it."""
    features = hf_features(schema)
    found = []
    for name in columns:
        index = schema.get_field_index(name)
        if index < 0:
            raise ValueError(
                f"{url} has no column {name!r}; its columns: {', '.join(schema.names)}. "
                "Pass columns=(...) naming the ones to read"
            )
        arrow_type = schema.field(index).type
        kind = _kind(arrow_type, features.get(name))
        if kind is None:
            raise ValueError(
                f"column {name!r} of {url} has the type {arrow_type}, which the Parquet reader "
                "does not give (it reads images (Hugging Face's Image), binary, integers, "
                "floats, strings and lists of numbers); leave it out of columns=(...)"
            )
        found.append(ColumnKind(name, kind, str(arrow_type)))
    return found


def _bytes_of(array: Any) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """(offsets, data) of a binary or string array: row ``i`` is ``data[offsets[i]:offsets[i +
    1]]``; views of its buffers (no copy)."""
    import pyarrow as pa

    if pa.types.is_fixed_size_binary(array.type):
        width = array.type.byte_width
        data_buffer = array.buffers()[1]
        data = np.frombuffer(data_buffer, np.uint8) if data_buffer is not None else np.empty(0)
        offsets = np.arange(array.offset, array.offset + len(array) + 1, dtype=np.int64) * width
        return offsets, data.astype(np.uint8, copy=False)
    large = pa.types.is_large_binary(array.type) or pa.types.is_large_string(array.type)
    buffers = array.buffers()
    dtype = np.int64 if large else np.int32
    offsets = np.frombuffer(buffers[1], dtype)[array.offset : array.offset + len(array) + 1]
    data = np.frombuffer(buffers[2], np.uint8) if buffers[2] is not None else np.empty(0, np.uint8)
    return offsets.astype(np.int64), data


def _bits(buffer: Any, offset: int, length: int) -> np.ndarray[Any, Any]:
    """``length`` bits of an Arrow bitmap (least significant bit first) from bit ``offset``, as
    booleans."""
    if length == 0:
        return np.zeros(0, dtype=bool)
    packed = np.frombuffer(buffer, np.uint8)
    return np.unpackbits(packed, count=offset + length, bitorder="little")[offset:].astype(bool)


def _valid(array: Any) -> np.ndarray[Any, Any] | None:
    """Which rows are not null (None: all are), from the array's validity bitmap."""
    if array.null_count == 0:
        return None
    bitmap = array.buffers()[0]
    if bitmap is None:  # (a null-typed array: every row null)
        return np.zeros(len(array), dtype=bool)
    return _bits(bitmap, array.offset, len(array))


def _dtype(arrow_type: Any) -> np.dtype[Any]:
    """The numpy dtype of an Arrow integer or floating type."""
    import pyarrow as pa

    width = arrow_type.bit_width // 8
    if pa.types.is_floating(arrow_type):
        return np.dtype(f"f{width}")
    return np.dtype(f"{'i' if pa.types.is_signed_integer(arrow_type) else 'u'}{width}")


def _numbers(array: Any) -> np.ndarray[Any, Any]:
    """An integer, floating or boolean array's values, nulls as 0, read from its buffers.

    Not ``to_numpy()`` nor ``fill_null(0)``: pyarrow imports pandas for either (0.18 s, in each
    worker, on the path to the first batch)."""
    import pyarrow as pa

    length, offset, data = len(array), array.offset, array.buffers()[1]
    if pa.types.is_boolean(array.type):
        values = _bits(data, offset, length) if data is not None else np.zeros(length, bool)
    else:
        dtype = _dtype(array.type)
        if data is None or length == 0:
            values = np.zeros(length, dtype)
        else:
            values = np.frombuffer(data, dtype)[offset : offset + length]
    valid = _valid(array)
    return values if valid is None else np.where(valid, values, values.dtype.type(0))


class Values:
    """One column of one read row group, as numpy arrays: :meth:`row` gives a row's value
    (``None`` for a null; for an ``image`` whose bytes are empty, its ``path`` as a ``str``, for
    the reader to read)."""

    def __init__(self, kind: str, array: Any, name: str = "") -> None:
        import pyarrow as pa

        if isinstance(array, pa.ChunkedArray):
            array = array.combine_chunks() if array.num_chunks != 1 else array.chunk(0)
        if isinstance(array.type, pa.BaseExtensionType):  # (the values its storage holds)
            array = array.storage
        if pa.types.is_dictionary(array.type):  # (each row's value, not its code)
            array = array.dictionary_decode()
        self.kind, self.name = kind, name
        self.valid = _valid(array)
        self.paths: Any = None
        #: rows whose value cannot be given as it is, and why (a uint64 past int64, a null
        #: inside a list of integers): :meth:`row` raises for them
        self.wrong: dict[int, str] = {}
        if kind == "image":
            inner = array.field("bytes")
            self.offsets, self.data = _bytes_of(inner)
            inner_valid = _valid(inner)
            if inner_valid is not None:
                self.valid = inner_valid if self.valid is None else self.valid & inner_valid
            names = {array.type.field(k).name for k in range(array.type.num_fields)}
            self.paths = array.field("path") if "path" in names else None
        elif kind in ("binary", "string"):
            self.offsets, self.data = _bytes_of(array)
        elif kind in ("int", "float"):
            dtype = np.int64 if kind == "int" else np.float32
            numbers = _numbers(array)
            self._past_int64(numbers)
            self._past_float32(numbers)
            with np.errstate(over="ignore"):  # (noted above: those rows fail, named)
                self.numbers = numbers.astype(dtype)
        else:  # list: its values between its first and last offsets (nulls' rows masked above)
            length, offset = len(array), array.offset
            if pa.types.is_fixed_size_list(array.type):
                size = array.type.list_size
                edges = np.arange(offset, offset + length + 1, dtype=np.int64) * size
            else:
                wide = pa.types.is_large_list(array.type)
                buffer = array.buffers()[1]
                edges = np.zeros(1, np.int64)
                if buffer is not None:
                    edges = np.frombuffer(buffer, np.int64 if wide else np.int32)
                    edges = edges[offset : offset + length + 1].astype(np.int64)
            first = int(edges[0]) if len(edges) else 0
            self.offsets = edges - first
            last = int(edges[-1]) if len(edges) else 0
            values = _numbers(array.values)[first:last]
            inside = _valid(array.values)
            if np.issubdtype(values.dtype, np.floating):
                self.data = values.astype(np.float32, copy=True)
                if inside is not None:  # (a null inside a list of floats: NaN, not 0)
                    self.data[~inside[first:last]] = np.nan
            else:
                self._past_int64(values, self.offsets)
                if inside is not None:  # (integers have no NaN: the row cannot be given)
                    nulls = np.flatnonzero(~inside[first:last])
                    for row in np.unique(np.searchsorted(self.offsets, nulls, side="right") - 1):
                        self.wrong.setdefault(int(row), "holds a null inside its list")
                self.data = values.astype(np.int64, copy=False)

    def _past_int64(
        self, values: np.ndarray[Any, Any], edges: np.ndarray[Any, Any] | None = None
    ) -> None:
        """Note the rows (a value each, or a list's values between ``edges``) of uint64
        ``values`` that int64 cannot hold. Costs nothing for any other dtype."""
        if values.dtype != np.uint64 or not len(values):
            return
        past = np.flatnonzero(values > np.iinfo(np.int64).max)
        rows = past if edges is None else np.searchsorted(edges, past, side="right") - 1
        for row in np.unique(rows):
            self.wrong.setdefault(int(row), "holds a uint64 past int64's largest (2**63 - 1)")

    def _past_float32(self, values: np.ndarray[Any, Any]) -> None:
        """Note the rows of float64 ``values`` that float32 cannot hold (finite, past its
        largest: they would come as infinities). Costs nothing for any other dtype."""
        if values.dtype != np.float64 or not len(values):
            return
        largest = float(np.finfo(np.float32).max)
        for row in np.flatnonzero(np.isfinite(values) & (np.abs(values) > largest)):
            self.wrong.setdefault(int(row), "holds a float past float32's largest (3.4e38)")

    def row(self, row: int) -> np.ndarray[Any, Any] | str | None:
        """Row ``row``'s value: a numpy array (a view for bytes), None for a null, the path of an
        image kept as a file. ``ValueError`` for a value that cannot be given as it is."""
        if row in self.wrong and (self.valid is None or self.valid[row]):
            raise ValueError(
                f"column {self.name!r} {self.wrong[row]}: the sample cannot be given as its "
                "value is (integers come as int64, floats as float32)"
            )
        if self.valid is not None and not self.valid[row]:
            if self.kind == "image" and self.paths is not None and self.paths[row].is_valid:
                return str(self.paths[row].as_py())
            return None
        kind = self.kind
        if kind in ("int", "float"):
            return self.numbers[row : row + 1]
        start, end = int(self.offsets[row]), int(self.offsets[row + 1])
        if kind == "image" and end == start and self.paths is not None:
            path = self.paths[row]
            return str(path.as_py()) if path.is_valid else None
        return self.data[start:end]


class ChunkedValues:
    """One column of a row group read in record batches (a large one: see
    :func:`~._sparse.batch_rows`): each batch's :class:`Values`, as one (never put together
    into one buffer, which would copy them all once more)."""

    def __init__(self, kind: str, chunks: list[Values], rows: list[int], name: str = "") -> None:
        self.kind, self.name, self.chunks = kind, name, chunks
        #: where each chunk starts (a list: looked up once per sample)
        self.starts = list(itertools.accumulate(rows[:-1], initial=0))

    def row(self, row: int) -> np.ndarray[Any, Any] | str | None:
        """Row ``row``'s value, as :meth:`Values.row` gives it."""
        chunk = bisect.bisect_right(self.starts, row) - 1
        return self.chunks[chunk].row(row - self.starts[chunk])


def values_of(kinds: list[ColumnKind], table: Any) -> list[Values | ChunkedValues]:
    """The :class:`Values` of each requested column of a read row group (an Arrow table; a
    column in several chunks: :class:`ChunkedValues`)."""
    found: list[Values | ChunkedValues] = []
    for kind in kinds:
        column = table.column(kind.name)
        if column.num_chunks <= 1:
            found.append(Values(kind.kind, column, kind.name))
            continue
        chunks = [Values(kind.kind, chunk, kind.name) for chunk in column.chunks]
        rows = [len(chunk) for chunk in column.chunks]
        found.append(ChunkedValues(kind.kind, chunks, rows, kind.name))
    return found


def default_value(kind: ColumnKind, value: Any) -> np.ndarray[Any, Any]:
    """An optional column's default (what a null in it gives) as the array a value of the
    column's kind gives: bytes or a ``str`` (UTF-8) for an image, binary or string column, an
    int (or bool) for an integer one, a number for a float one, a sequence of numbers for a
    list one. ``TypeError`` naming the column and what it takes otherwise."""
    name, taken = kind.name, kind.kind
    if taken in ("image", "binary", "string"):
        if isinstance(value, str):
            value = value.encode()
        if isinstance(value, (bytes, bytearray, memoryview)):
            return np.frombuffer(bytes(value), np.uint8).copy()
        wants = "bytes or a str (stored as UTF-8)"
    elif taken == "int":
        if isinstance(value, (bool, int, np.integer, np.bool_)):
            return np.array([int(value)], np.int64)
        wants = "an int"
    elif taken == "float":
        if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
            return np.array([value], np.float32)
        wants = "a number"
    else:  # list
        try:
            array = np.asarray(value)
        except (TypeError, ValueError):
            array = np.empty(0, object)
        if array.ndim == 1 and (array.size == 0 or np.issubdtype(array.dtype, np.number)):
            floats = any(word in kind.type for word in ("float", "double", "halffloat"))
            return array.astype(np.float32 if floats else np.int64)
        wants = "a sequence of numbers"
    raise TypeError(
        f"optional[{name!r}] must be {wants} (column {name!r} is {kind.type}), got {value!r}"
    )
