"""The columns of a Parquet dataset's files: the kinds of the requested ones, which must agree
across files (:func:`checked_schemas`), and which leaf columns (column chunks) hold them
(:func:`leaf_columns`). Runs in the worker (and in the trainer for a ``datasets.Dataset``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ._columns import ColumnKind, column_kinds

__all__ = ["agree", "checked_schemas", "given_as", "leaf_columns"]


def leaf_columns(footer: Any, wanted: set[str]) -> list[int]:
    """The indexes of the leaf columns (column chunks) of the top-level columns ``wanted`` in
    a file's footer: counted through its Arrow schema, field by field (a column's name may hold
    a dot, as a struct's leaf's path does: ``label.v1``)."""
    counted, found = 0, list[int]()
    for field in footer.schema.to_arrow_schema():
        leaves = _leaves(field.type)
        if field.name in wanted:
            found.extend(range(counted, counted + leaves))
        counted += leaves
    if counted != footer.num_columns:  # (a type counted otherwise: by the leaves' paths)
        return [
            k
            for k in range(footer.num_columns)
            if footer.schema.column(k).path.split(".")[0] in wanted
        ]
    return found


def _leaves(kind: Any) -> int:
    """The Parquet leaf columns an Arrow type is stored in."""
    import pyarrow as pa

    if isinstance(kind, pa.BaseExtensionType):
        return _leaves(kind.storage_type)
    if pa.types.is_struct(kind):
        return sum(_leaves(kind.field(k).type) for k in range(kind.num_fields))
    if pa.types.is_map(kind):
        return _leaves(kind.key_type) + _leaves(kind.item_type)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return _leaves(kind.value_type)
    return 1


def checked_schemas(urls: list[str], schemas: Iterable[Any], columns: tuple[str, ...]) -> Any:
    """The kinds of ``columns``, the same in every file (``schemas``: their Arrow schemas, in
    order, one at a time): ``ValueError`` naming both files and the column when one file's type
    differs from the first's. A file given the very schema object of the one before it is not
    looked at again."""
    given = iter(schemas)
    last = next(given)
    kinds = column_kinds(last, columns, urls[0])
    for url, schema in zip(urls[1:], given, strict=True):
        if schema is last:
            continue
        last = schema
        agree(kinds, urls[0], url, schema, columns)
    return kinds


def agree(
    kinds: list[ColumnKind], first: str, url: str, schema: Any, columns: tuple[str, ...]
) -> None:
    """``ValueError`` naming both files and the column when a column of ``url`` (its Arrow
    ``schema``) has another type than in the first file (``kinds``)."""
    for mine, other in zip(kinds, column_kinds(schema, columns, url), strict=True):
        if given_as(mine) != given_as(other):
            raise ValueError(
                f"column {mine.name!r} is {mine.type} in {first} but {other.type} in "
                f"{url}: the files of one dataset must share their columns' types (integers "
                "of any width, floats of any width, binary of any width, strings of any width "
                "and lists of either numbers mix: they come as int64, float32, bytes and arrays)"
            )


def given_as(kind: ColumnKind) -> tuple[str, bool]:
    """What the reader gives a column of ``kind`` as: its kind, and for a list whether of
    floats (float32) or not (int64)."""
    floats = any(word in kind.type for word in ("float", "double", "halffloat"))
    return kind.kind, kind.kind == "list" and floats
