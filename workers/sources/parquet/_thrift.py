"""Thrift's compact protocol, read and written without a schema: what a Parquet footer, a page
header and a page index are made of. Runs in the worker.

pyarrow reads a footer but says nothing of a column chunk's page index, and reads no less than a
row group; :mod:`._pages` needs both, so it reads the Thrift itself. A struct is a
:class:`Struct`, field id -> ``(type, value)`` in the order the fields came, so that what is read
is written back byte for byte (:func:`encode`) with only the fields changed that the caller set.
A list or set is ``(element type, [values])``, a map ``(key type, value type, [(key, value)])``.
"""

from __future__ import annotations

import struct as packing
from typing import Any

__all__ = ["BINARY", "I32", "I64", "LIST", "STRUCT", "Struct", "decode", "encode"]

STOP, TRUE, FALSE, BYTE, I16, I32, I64, DOUBLE, BINARY, LIST, SET, MAP, STRUCT = range(13)


class Struct(dict[int, tuple[int, Any]]):
    """A Thrift struct: field id -> (compact type, value)."""

    def get_value(self, field: int, default: Any = None) -> Any:
        found = self.get(field)
        return default if found is None else found[1]


class _Reader:
    def __init__(self, data: bytes | memoryview, at: int) -> None:
        self.data, self.at = memoryview(data), at

    def byte(self) -> int:
        if self.at >= len(self.data):
            raise ValueError("Thrift data ends inside a value")
        value = self.data[self.at]
        self.at += 1
        return int(value)

    def varint(self) -> int:
        shift = result = 0
        while True:
            byte = self.byte()
            result |= (byte & 0x7F) << shift
            if byte < 0x80:
                return result
            shift += 7
            if shift > 70:
                raise ValueError("a Thrift varint longer than 10 bytes")

    def zigzag(self) -> int:
        number = self.varint()
        return (number >> 1) ^ -(number & 1)

    def value(self, kind: int) -> Any:
        if kind in (TRUE, FALSE):
            return kind == TRUE
        if kind == BYTE:
            byte = self.byte()
            return byte - 256 if byte > 127 else byte
        if kind in (I16, I32, I64):
            return self.zigzag()
        if kind == DOUBLE:
            (number,) = packing.unpack_from("<d", self.data, self.at)
            self.at += 8
            return number
        if kind == BINARY:
            size = self.varint()
            if self.at + size > len(self.data):
                raise ValueError("Thrift data ends inside a binary value")
            data = bytes(self.data[self.at : self.at + size])
            self.at += size
            return data
        if kind in (LIST, SET):
            header = self.byte()
            size, element = header >> 4, header & 0x0F
            if size == 15:
                size = self.varint()
            return element, [self.element(element) for _ in range(size)]
        if kind == MAP:
            size = self.varint()
            if size == 0:
                return STOP, STOP, []
            types = self.byte()
            keys, values = types >> 4, types & 0x0F
            pairs = [(self.element(keys), self.element(values)) for _ in range(size)]
            return keys, values, pairs
        if kind == STRUCT:
            return self.struct()
        raise ValueError(f"unknown Thrift compact type {kind}")

    def element(self, kind: int) -> Any:
        if kind in (TRUE, FALSE):  # a collection's booleans are a byte each
            return self.byte() == TRUE
        return self.value(kind)

    def struct(self) -> Struct:
        fields, last = Struct(), 0
        while True:
            header = self.byte()
            kind = header & 0x0F
            if kind == STOP:
                return fields
            delta = header >> 4
            field = last + delta if delta else self.zigzag()
            fields[field] = (kind, self.value(kind))
            last = field


def decode(data: bytes | memoryview, at: int = 0) -> tuple[Struct, int]:
    """The struct at ``data[at:]`` and where it ends; ``ValueError`` when it is not one."""
    reader = _Reader(data, at)
    try:
        return reader.struct(), reader.at
    except (IndexError, packing.error, RecursionError) as error:
        raise ValueError(f"not a Thrift struct: {error}") from None


def _varint(out: bytearray, number: int) -> None:
    while number > 0x7F:
        out.append((number & 0x7F) | 0x80)
        number >>= 7
    out.append(number)


def _zigzag(out: bytearray, number: int) -> None:
    _varint(out, (number << 1) ^ (number >> 63))


def _write(out: bytearray, kind: int, value: Any) -> None:
    if kind in (TRUE, FALSE):
        out.append(TRUE if value else FALSE)
    elif kind == BYTE:
        out.append(value & 0xFF)
    elif kind in (I16, I32, I64):
        _zigzag(out, value)
    elif kind == DOUBLE:
        out += packing.pack("<d", value)
    elif kind == BINARY:
        _varint(out, len(value))
        out += value
    elif kind in (LIST, SET):
        element, items = value
        if len(items) < 15:
            out.append(len(items) << 4 | element)
        else:
            out.append(0xF0 | element)
            _varint(out, len(items))
        for item in items:
            _write(out, element, item)
    elif kind == MAP:
        keys, values, pairs = value
        _varint(out, len(pairs))
        if pairs:
            out.append(keys << 4 | values)
        for key, item in pairs:
            _write(out, keys, key)
            _write(out, values, item)
    elif kind == STRUCT:
        _struct(out, value)
    else:
        raise ValueError(f"unknown Thrift compact type {kind}")


def _struct(out: bytearray, fields: Struct) -> None:
    last = 0
    for field, (kind, value) in fields.items():
        if kind in (TRUE, FALSE):
            kind = TRUE if value else FALSE
        delta = field - last
        if 0 < delta <= 15:
            out.append(delta << 4 | kind)
        else:
            out.append(kind)
            _zigzag(out, field)
        if kind not in (TRUE, FALSE):
            _write(out, kind, value)
        last = field
    out.append(STOP)


def encode(fields: Struct) -> bytes:
    """The compact bytes of a struct (fields in their order)."""
    out = bytearray()
    _struct(out, fields)
    return bytes(out)
