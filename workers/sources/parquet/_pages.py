"""Some rows of a row group, read from the pages that hold them. Runs in the worker.

A file written with a page index (``datasets`` >= 4.6 writes one, its image columns in pages of
about a megabyte; pyarrow with ``write_page_index=True``) keeps, for each column chunk, its
*offset index*: where each page begins, its size and its first row. A worker that needs only rows
``[lo, hi)`` of a large row group -- its part of a row group that the layout cuts between workers
and ranks, or the rows still owed of one partly delivered before a resume -- reads the offset
indexes of the requested columns (one ranged read: they lie together before the footer), then
each requested leaf column's pages that hold those rows (and its dictionary page), ranges apart
by a small gap read as one.

pyarrow decodes no less than a row group, so each leaf's pages are made a Parquet file of their
own (:func:`leaf_file`): the pages' bytes as they are, behind the file's own footer with one row
group of those pages' rows. Leaves are read apart because their pages begin at different rows (a
label column often has one page for the whole row group); each is sliced to ``[lo, hi)`` and a
struct's leaves (``Image``'s ``bytes`` and ``path``) are put together again.

A plan uses this only where it saves most of a row group's bytes (:func:`worth_it`), and only
over columns it knows how to put together (a plain column, or a struct of plain fields); a file
without a page index, or whose index does not parse, is read a row group at a time, as before.
"""

from __future__ import annotations

import bisect
import struct as packing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from . import _thrift as thrift
from ._thrift import I64, LIST, STRUCT, Struct

__all__ = [
    "IndexLies",
    "LeafPages",
    "decode_footer",
    "index_range",
    "leaf_file",
    "leaves_of",
    "page_values",
    "pages_for",
    "put_together",
    "read_leaf",
    "read_part",
    "repeated",
    "worth_it",
]

#: Row groups smaller than this are read whole (a page is about a megabyte: a smaller one holds
#: few pages, and an index read would cost more than the pages it saves).
MIN_BYTES = 4 << 20
#: Pages are read in place of the row group only where they are at most this share of its bytes.
SHARE = 0.6

# Parquet's page types (PageHeader.type)
_DATA_PAGE, _DATA_PAGE_V2 = 0, 3


@dataclass(frozen=True)
class LeafPages:
    """What to read of one leaf column for some rows: its index among the file's leaves, its
    dictionary page's bytes ``[start, end)`` (None without one), its pages' bytes, and the rows
    of the row group those pages hold, ``[first, end)``."""

    leaf: int
    dictionary: tuple[int, int] | None
    pages: tuple[int, int]
    rows: tuple[int, int]


def worth_it(size: int, count: int, rows: tuple[int, int] | None) -> bool:
    """Whether ``rows`` ``[lo, hi)`` of a row group of ``count`` rows and ``size`` bytes are
    worth reading by their pages (None: all of them are needed)."""
    return rows is not None and size >= MIN_BYTES and (rows[1] - rows[0]) <= SHARE * count


def _columns(footer: Struct, group: int) -> list[Struct]:
    row_groups = footer.get_value(4)[1]
    return list(row_groups[group].get_value(1)[1])


def leaves_of(footer: Struct, names: Sequence[str]) -> list[list[int]] | None:
    """Per requested column, its leaves' indexes (in the schema's order); None when one of them
    is a struct with a struct in it (a column of one leaf, a list's too, is read whole by it; a
    struct of plain fields by each field), or a leaf has no offset index."""
    columns = _columns(footer, 0) if footer.get_value(4)[1] else []
    paths = [tuple(p.decode() for p in c.get_value(3).get_value(3)[1]) for c in columns]
    found = []
    for name in names:
        leaves = [k for k, path in enumerate(paths) if path[0] == name]
        if not leaves or any(columns[k].get_value(4) is None for k in leaves):
            return None
        if len(leaves) > 1 and any(len(paths[k]) != 2 for k in leaves):
            return None  # (a struct of structs: its leaves' reads would not put it together)
        found.append(leaves)
    return found


def index_range(footer: Struct, group: int, leaves: Sequence[int]) -> tuple[int, int] | None:
    """The bytes that hold the offset indexes of ``leaves`` in row group ``group``; None when
    one of them has none."""
    columns = _columns(footer, group)
    spans = []
    for leaf in leaves:
        offset, length = columns[leaf].get_value(4), columns[leaf].get_value(5)
        if offset is None or not length or offset <= 0:
            return None
        spans.append((offset, offset + length))
    return min(s for s, _e in spans), max(e for _s, e in spans)


def pages_for(
    footer: Struct, group: int, leaves: Sequence[int], index: bytes, at: int, lo: int, hi: int
) -> list[LeafPages]:
    """What to read of each of ``leaves`` for rows ``[lo, hi)`` of row group ``group``, from
    their offset indexes (``index``: the bytes from ``at``). ``ValueError`` when an index does
    not describe the chunk (pages out of order, outside it, or not from row 0)."""
    columns = _columns(footer, group)
    rows = int(footer.get_value(4)[1][group].get_value(3))
    found = []
    for leaf in leaves:
        chunk = columns[leaf]
        offset_index, _end = thrift.decode(index, chunk.get_value(4) - at)
        pages = offset_index.get_value(1, (STRUCT, []))[1]
        starts = [int(p.get_value(1)) for p in pages]
        firsts = [int(p.get_value(3)) for p in pages]
        sizes = [int(p.get_value(2)) for p in pages]
        meta = chunk.get_value(3)
        data, length = int(meta.get_value(9)), int(meta.get_value(7))
        if (
            not pages
            or firsts[0] != 0
            or firsts != sorted(firsts)
            or firsts[-1] >= rows
            or any(b != a + n for a, n, b in zip(starts, sizes, starts[1:], strict=False))
            or starts[0] < data
        ):
            raise ValueError(f"the offset index of leaf {leaf} does not describe its pages")
        first = bisect.bisect_right(firsts, lo) - 1
        last = bisect.bisect_left(firsts, hi)  # (pages first .. last - 1)
        dictionary = meta.get_value(11)
        has_dictionary = dictionary is not None and 0 < dictionary < data
        if starts[-1] + sizes[-1] > (dictionary if has_dictionary else data) + length:
            raise ValueError(f"the offset index of leaf {leaf} reaches past its chunk")
        found.append(
            LeafPages(
                leaf,
                (dictionary, starts[0]) if has_dictionary else None,
                (starts[first], starts[last - 1] + sizes[last - 1]),
                (firsts[first], firsts[last] if last < len(firsts) else rows),
            )
        )
    return found


def _values(data: bytes | memoryview) -> tuple[int, int]:
    """The values the pages in ``data`` hold, and their uncompressed size (headers and pages),
    walking their headers; ``ValueError`` when they do not fill ``data`` exactly."""
    at = values = uncompressed = 0
    while at < len(data):
        header, end = thrift.decode(data, at)
        kind, compressed = header.get_value(1), header.get_value(3)
        if kind is None or compressed is None or compressed < 0:
            raise ValueError(f"no page header at byte {at} of the pages read")
        if kind == _DATA_PAGE:
            values += int(header.get_value(5).get_value(1))
        elif kind == _DATA_PAGE_V2:
            values += int(header.get_value(8).get_value(1))
        uncompressed += end - at + int(header.get_value(2, 0))
        at = end + compressed
    if at != len(data):
        raise ValueError("the pages read end inside a page")
    return values, uncompressed


class IndexLies(ValueError):
    """A page index whose row numbers are not those of the pages it points to: the row group
    is read whole instead (its data may be sound)."""


def read_part(
    pq: Any,
    pa: Any,
    footer: Struct,
    group: int,
    part: LeafPages,
    dictionary: bytes | memoryview,
    pages: bytes | memoryview,
) -> Any:
    """The rows ``part`` promises of its leaf (an Arrow array), from its ``dictionary`` page and
    its ``pages``; :class:`IndexLies` where they hold other rows than the offset index said."""
    made = leaf_file(footer, group, part, dictionary, pages)
    array = read_leaf(pq, pa, made, part.leaf)
    rows = part.rows[1] - part.rows[0]
    if len(array) != rows:
        raise IndexLies(f"leaf {part.leaf}'s pages hold {len(array)} rows, not {rows}")
    told = page_values(pages)
    if told != rows and not repeated(pa, array.type):
        # (an offset index whose first rows lie: the pages hold other rows)
        raise IndexLies(
            f"leaf {part.leaf}'s pages hold {told} values, its offset index says {rows} rows"
        )
    return array


def page_values(pages: bytes | memoryview) -> int:
    """The values the data pages in ``pages`` hold, as their headers say."""
    return _values(pages)[0]


def repeated(pa: Any, kind: Any) -> bool:
    """Whether an Arrow type holds a list (or map) anywhere: its pages' values are not rows."""
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_map(kind):
        return True
    if pa.types.is_fixed_size_list(kind):
        return True
    if pa.types.is_struct(kind):
        return any(repeated(pa, kind.field(k).type) for k in range(kind.num_fields))
    return False


def leaf_file(
    footer: Struct,
    group: int,
    part: LeafPages,
    dictionary: bytes | memoryview,
    pages: bytes | memoryview,
) -> bytes:
    """A Parquet file of one row group holding ``part``'s rows: its leaf's ``dictionary`` page
    (empty without one) and ``pages``, behind ``footer`` (the real file's) made to describe
    them. Only that leaf may be read of it."""
    (dictionary_values, dictionary_size), (values, uncompressed) = (
        _values(dictionary),
        _values(pages),
    )
    values, uncompressed = values + dictionary_values, uncompressed + dictionary_size
    rows = part.rows[1] - part.rows[0]
    columns = _columns(footer, group)
    meta = Struct(columns[part.leaf].get_value(3))
    meta[5] = (I64, values)
    meta[6] = (I64, uncompressed)
    meta[7] = (I64, len(dictionary) + len(pages))
    meta[9] = (I64, 4 + len(dictionary))
    if dictionary:
        meta[11] = (I64, 4)
    for gone in (10, 11, 12, 14, 15, 16) if not dictionary else (10, 12, 14, 15, 16):
        meta.pop(gone, None)  # (another page's offset, statistics of all the rows, a bloom filter)
    chunk = Struct(columns[part.leaf])
    for gone in (4, 5, 6, 7):  # (its page index)
        chunk.pop(gone, None)
    chunk[2] = (I64, 4)
    chunk[3] = (STRUCT, meta)
    columns[part.leaf] = chunk
    row_group = Struct(footer.get_value(4)[1][group])
    row_group[1] = (LIST, (STRUCT, columns))
    row_group[3] = (I64, rows)
    for gone in (5, 6):  # (where the row group began, its size)
        row_group.pop(gone, None)
    made = Struct(footer)
    made[3] = (I64, rows)
    made[4] = (LIST, (STRUCT, [row_group]))
    encoded = thrift.encode(made)
    return b"".join(
        (b"PAR1", dictionary, pages, encoded, packing.pack("<I", len(encoded)), b"PAR1")
    )


def decode_footer(data: bytes) -> Struct:
    """A footer's Thrift (``ValueError`` when it is not one, or has more after it)."""
    footer, end = thrift.decode(data)
    if end != len(data) or footer.get_value(4) is None:
        raise ValueError("not a Parquet footer")
    return footer


def read_leaf(pq: Any, pa: Any, data: bytes, leaf: int) -> Any:
    """The one column (an Arrow array) of a :func:`leaf_file`: leaf number ``leaf`` (by number:
    its dotted path may be another column's name, ``a.b`` beside ``a{b}``)."""
    reader = pq.ParquetFile(pa.BufferReader(data), page_checksum_verification=True)
    table = reader.reader.read_row_group(0, [leaf], use_threads=False)
    column = table.column(0)
    return column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)


def put_together(pa: Any, arrays: Sequence[Any]) -> Any:
    """A requested column from its leaves' arrays (each already sliced to the same rows): the
    array itself for a plain column; for a struct, its fields from each leaf's read (each
    holding that field alone), its nulls from the first."""
    if len(arrays) == 1:
        return arrays[0]
    children = [array.field(0) for array in arrays]
    fields = [array.type.field(0) for array in arrays]
    return pa.StructArray.from_arrays(children, fields=fields, mask=arrays[0].is_null())
