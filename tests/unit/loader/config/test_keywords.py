"""The Loader's keywords are declared once, as LoaderConfig's fields; its signature agrees."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from loader import Loader
from loader.config._config import LoaderConfig
from loader.config._keywords import checked_keywords, keyword, keyword_fields, spec
from loader.config._validate import check_positive_int

KINDS = {False: inspect.Parameter.KEYWORD_ONLY, True: inspect.Parameter.POSITIONAL_OR_KEYWORD}


def differences(function: Callable[..., Any], config_type: type) -> list[str]:
    """Where ``function``'s parameters (``self`` left out) and ``config_type``'s keyword fields
    differ: names and their order, defaults, kinds."""
    parameters = [p for p in inspect.signature(function).parameters.values() if p.name != "self"]
    fields = keyword_fields(config_type)
    found = []
    if [p.name for p in parameters] != [f.name for f in fields]:
        found.append(
            f"names: signature {[p.name for p in parameters]} != fields {[f.name for f in fields]}"
        )
    declared = {f.name: f for f in fields}
    for parameter in parameters:
        field = declared.get(parameter.name)
        if field is None:
            continue
        default = inspect.Parameter.empty if field.default is dataclasses.MISSING else field.default
        if parameter.default != default or type(parameter.default) is not type(default):
            found.append(f"{parameter.name}: default {parameter.default!r} != {default!r}")
        if parameter.kind != KINDS[spec(field).positional]:
            found.append(
                f"{parameter.name}: kind {parameter.kind} != {KINDS[spec(field).positional]}"
            )
    return found


def test_the_loaders_signature_is_the_configs_keywords() -> None:
    """Adding a keyword is one field of LoaderConfig and one line of ``Loader.__init__``."""
    assert differences(Loader.__init__, LoaderConfig) == []
    names = [f.name for f in keyword_fields(LoaderConfig)]
    assert names[:3] == ["source", "step", "batch_size"] and len(names) == 27
    # what follows from the keywords is no keyword
    assert {"local_world_size", "cpus", "first_epoch", "workers_auto"}.isdisjoint(names)


@dataclass(frozen=True, kw_only=True)
class _Config:
    source: Any = keyword(positional=True)  # noqa: RUF009 (a dataclasses.field)
    size: int = keyword(check=check_positive_int)
    depth: int = keyword(2, check=check_positive_int)
    settled: int = 0  # not a keyword


def _same(self: object, source: Any, *, size: int, depth: int = 2) -> None: ...
def _one_more(self: object, source: Any, *, size: int, depth: int = 2, extra: int = 0) -> None: ...
def _one_less(self: object, source: Any, *, size: int) -> None: ...
def _other_default(self: object, source: Any, *, size: int, depth: int = 3) -> None: ...
def _default_type(self: object, source: Any, *, size: int, depth: float = 2.0) -> None: ...
def _positional(self: object, source: Any, size: int, *, depth: int = 2) -> None: ...
def _required(self: object, source: Any, *, size: int = 1, depth: int = 2) -> None: ...
def _reordered(self: object, source: Any, *, depth: int = 2, size: int) -> None: ...


@pytest.mark.parametrize(
    ("function", "what"),
    [
        (_one_more, "names"),
        (_one_less, "names"),
        (_other_default, "depth: default"),
        (_default_type, "depth: default"),
        (_positional, "size: kind"),
        (_required, "size: default"),
        (_reordered, "names"),
    ],
)
def test_the_comparison_finds_a_keyword_on_one_side_only(
    function: Callable[..., Any], what: str
) -> None:
    assert differences(_same, _Config) == []
    found = differences(function, _Config)
    assert found and found[0].startswith(what), found


def test_a_keyword_not_given_takes_its_fields_default_through_its_check() -> None:
    assert checked_keywords(_Config, {"source": "s", "size": 4}) == {
        "source": "s",
        "size": 4,
        "depth": 2,
    }
    with pytest.raises(ValueError, match="depth must be >= 1, got 0"):
        checked_keywords(_Config, {"source": "s", "size": 4, "depth": 0})


def test_an_unknown_or_missing_keyword_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'settled'"):
        checked_keywords(_Config, {"source": "s", "size": 4, "settled": 1})
    with pytest.raises(TypeError, match="missing required argument: 'size'"):
        checked_keywords(_Config, {"source": "s"})
