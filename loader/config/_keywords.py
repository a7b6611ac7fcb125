"""The Loader's keywords, declared once: as fields of :class:`~loader.config.LoaderConfig`.

A field made with :func:`keyword` is a parameter of :class:`loader.Loader`: its default there is
the field's default, and its check (``check(value, name)``, which returns the value to keep)
sits beside it. ``Loader.__init__`` spells the same list for IDEs and ``help()``; a unit test
keeps the two equal (names, defaults, kinds). A keyword without a check is checked jointly,
with others or with the placement, by ``LoaderConfig.build``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

#: What a keyword's check is: ``check(value, name)`` raises a ``TypeError``/``ValueError`` that
#: says what to change, or returns the value to keep (normalised).
Check = Callable[[Any, str], Any]

_KEY = "loader keyword"


@dataclass(frozen=True)
class Keyword:
    """What a field's metadata says of the Loader parameter it is."""

    check: Check | None  # None: checked jointly by LoaderConfig.build
    positional: bool  # source and step: positional or keyword; the others keyword-only


def keyword(
    default: Any = dataclasses.MISSING, *, check: Check | None = None, positional: bool = False
) -> Any:
    """A configuration field that is also a Loader parameter, with its default (none: required)
    and its check."""
    return dataclasses.field(
        default=default, metadata={_KEY: Keyword(check=check, positional=positional)}
    )


def keyword_fields(config_type: type) -> tuple[dataclasses.Field[Any], ...]:
    """The fields of ``config_type`` that are Loader parameters, in the signature's order."""
    return tuple(f for f in dataclasses.fields(config_type) if _KEY in f.metadata)


def spec(field: dataclasses.Field[Any]) -> Keyword:
    """The keyword a field declares."""
    keyword_spec = field.metadata[_KEY]
    assert isinstance(keyword_spec, Keyword)
    return keyword_spec


def checked_keywords(config_type: type, given: Mapping[str, Any]) -> dict[str, Any]:
    """Every keyword of ``config_type``: the given value or its default, through its check
    (in declaration order); a name that is no keyword, or a required one missing, is a
    ``TypeError`` as Python's for a call."""
    fields = keyword_fields(config_type)
    unknown = sorted(given.keys() - {f.name for f in fields})
    if unknown:
        raise TypeError(f"Loader() got an unexpected keyword argument {unknown[0]!r}")
    out: dict[str, Any] = {}
    for field in fields:
        if field.name in given:
            value = given[field.name]
        elif field.default is not dataclasses.MISSING:
            value = field.default
        else:
            raise TypeError(f"Loader() missing required argument: {field.name!r}")
        check = spec(field).check
        out[field.name] = value if check is None else check(value, field.name)
    return out
