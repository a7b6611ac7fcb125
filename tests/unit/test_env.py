"""Rank discovery from the environment: RANK and WORLD_SIZE come together or not at all."""

from __future__ import annotations

import pytest

from loader._env import Placement, discover_placement

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    ("given", "value", "missing"),
    [("RANK", "1", "WORLD_SIZE"), ("RANK", "0", "WORLD_SIZE"), ("WORLD_SIZE", "2", "RANK")],
)
def test_half_of_rank_and_world_size_is_an_error(
    monkeypatch: pytest.MonkeyPatch, given: str, value: str, missing: str
) -> None:
    monkeypatch.setenv(given, value)
    with pytest.raises(ValueError, match=rf"{given}='{value}' is set but {missing} is not"):
        discover_placement(None, None)


def test_an_empty_variable_counts_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "")
    with pytest.raises(ValueError, match="is set but WORLD_SIZE is not"):
        discover_placement(None, None)


def test_both_variables_place_the_trainer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert discover_placement(None, None) == Placement(1, 2, 0, 1, "environment")


def test_neither_variable_is_a_single_process() -> None:
    assert discover_placement(None, None) == Placement(0, 1, 0, 1, "default")


def test_explicit_arguments_place_the_trainer_despite_half_an_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RANK", "1")
    assert discover_placement(1, 2) == Placement(1, 2, 1, 1, "arguments")
