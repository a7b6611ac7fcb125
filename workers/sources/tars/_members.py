"""What a tar sample's outputs are made of: ``ext`` parsed (alternatives, WebDataset's
``__key__`` and ``__url__``), the members that are optional and their defaults, and the text
integers of ``cls``-like members. Runs in the worker.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["INTEGER_EXTS", "KEY", "URL", "Members", "decode_int", "parse_ext"]

#: Extensions whose members are text integers (WebDataset's convention): decoded to int arrays.
INTEGER_EXTS: dict[str, type[np.integer[Any]]] = {
    "cls": np.int32,
    "cls2": np.int32,
    "class": np.int32,
    "label": np.int32,
    "count": np.int64,
    "index": np.int64,
    "inx": np.int64,
    "id": np.int64,
}

#: Outputs that are no member, as WebDataset names them: the sample's key (``000010042``)
#: and its shard's URL, each as UTF-8 bytes (a uint8 array, like a ``.txt`` member).
KEY, URL = "__key__", "__url__"


def parse_ext(ext: str | Sequence[str]) -> list[list[str]]:
    """``ext`` as a list of alternatives per output (``"jpg;png"`` -> ``["jpg", "png"]``)."""
    items = [ext] if isinstance(ext, str) else list(ext)
    if not items:
        raise ValueError("ext must name at least one extension, e.g. ext=('jpg', 'cls')")
    parsed = []
    for item in items:
        if not isinstance(item, str) or not item.strip(";"):
            raise ValueError(f"ext entries must be extension names like 'jpg', got {item!r}")
        parsed.append([part.lstrip(".") for part in item.split(";") if part])
    for alternatives in parsed:
        if len(alternatives) > 1 and any(a in (KEY, URL) for a in alternatives):
            raise ValueError(f"{KEY} and {URL} have no alternatives: got {';'.join(alternatives)}")
    return parsed


def decode_int(text: bytes, dtype: Any, where: str) -> np.ndarray[Any, Any]:
    """A text integer member as a one-element array; ``ValueError`` naming it (``where``)."""
    try:
        return np.array([int(text)], dtype=dtype)
    except ValueError:
        raise ValueError(f"{where} is not an integer: {text[:40]!r}") from None


def _default_array(name: str, value: Any) -> np.ndarray[Any, Any]:
    """An optional member's default as the array a present one would give."""
    dtype = INTEGER_EXTS.get(name)
    if dtype is not None:
        if isinstance(value, (bytes, str)):
            return decode_int(value.encode() if isinstance(value, str) else value, dtype, name)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"optional[{name!r}] must be an int (a .{name} is one), got {value!r}")
        return np.array([value], dtype=dtype)
    if isinstance(value, str):
        value = value.encode()
    if isinstance(value, (bytes, bytearray)):
        return np.frombuffer(bytes(value), dtype=np.uint8).copy()
    if isinstance(value, np.ndarray):
        return value.copy()
    raise TypeError(
        f"optional[{name!r}] must be bytes, a str (stored as UTF-8) or a numpy array, "
        f"got {type(value).__name__}"
    )


class Members:
    """Per output: a member (any of its alternatives), the key or the URL; which members are
    optional, and the array each gives when a sample lacks it."""

    def __init__(
        self, wanted: Sequence[Sequence[str]], optional: Mapping[str, Any] | None = None
    ) -> None:
        self.names = [alternatives[0] for alternatives in wanted]
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"ext names an output twice: {self.names}")
        #: per output: "member", KEY or URL
        self.kinds = [name if name in (KEY, URL) else "member" for name in self.names]
        optional = dict(optional or {})
        if not isinstance(optional, dict) or not all(isinstance(k, str) for k in optional):
            raise TypeError("optional must be a dict of extension -> default, e.g. {'txt': b''}")
        by_alternative = {
            ext: column for column, alternatives in enumerate(wanted) for ext in alternatives
        }
        #: column -> the default of an optional member
        self.defaults: dict[int, np.ndarray[Any, Any]] = {}
        for name, value in optional.items():
            column = by_alternative.get(name.lstrip("."))
            if column is None or self.kinds[column] != "member":
                raise ValueError(
                    f"optional names {name!r}, which is not a member among ext="
                    f"{tuple(';'.join(a) for a in wanted)}; name one of those"
                )
            self.defaults[column] = _default_array(self.names[column], value)
        self.integers = [INTEGER_EXTS.get(name) for name in self.names]

    def outputs(
        self,
        offsets: list[int],
        sizes: list[int],
        data: np.ndarray[Any, Any],
        start: int,
        named: tuple[str, str],
        check: Callable[[np.ndarray[Any, Any], int], None],
    ) -> list[np.ndarray[Any, Any]]:
        """A sample's outputs: its members (at ``offsets`` with ``sizes`` in the file; ``data``
        holds its bytes from ``start``), the default of an optional one it lacks (size -1),
        and its key and URL (``named``). ``check(member, offset)`` raises for an image member
        over the pixel limit."""
        key, url = named
        made = []
        for column, (offset, size) in enumerate(zip(offsets, sizes, strict=True)):
            kind = self.kinds[column]
            if kind != "member":
                text = key if kind == KEY else url
                made.append(np.frombuffer(text.encode("utf-8", "surrogateescape"), np.uint8))
            elif size < 0:
                made.append(self.defaults[column])
            elif self.integers[column] is None:
                member = data[offset - start : offset - start + size]
                check(member, offset)
                made.append(member)
            else:
                raw = data[offset - start : offset - start + size].tobytes()
                where = f"{url}: {key}.{self.names[column]}"
                made.append(decode_int(raw, self.integers[column], where))
        return made
