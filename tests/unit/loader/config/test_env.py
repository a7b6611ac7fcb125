"""Rank discovery from the environment: RANK needs WORLD_SIZE; WORLD_SIZE without RANK (Lightning's
DDP launcher) is a provisional guess, settled by the process group at the first epoch."""

from __future__ import annotations

import pytest

from loader.config._env import Placement, discover_placement, settle_placement

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK")


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    ("given", "value", "missing"),
    [("RANK", "1", "WORLD_SIZE"), ("RANK", "0", "WORLD_SIZE")],
)
def test_half_of_rank_and_world_size_is_an_error(
    monkeypatch: pytest.MonkeyPatch, given: str, value: str, missing: str
) -> None:
    monkeypatch.setenv(given, value)
    with pytest.raises(ValueError, match=rf"{given}='{value}' is set but {missing} is not"):
        discover_placement(None, None)


def test_lightning_launcher_variables_are_a_provisional_placement(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What Lightning's DDP launcher gives a child rank before fit() sets up the group."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("NODE_RANK", "0")
    placement = discover_placement(None, None)
    assert (placement.rank, placement.world_size, placement.source) == (1, 2, "launcher")
    assert placement.provisional
    assert placement.local_world_size == 2  # one node: the ranks share this machine's CPUs
    # no group by the first epoch: the rank is still unknown, said then
    with pytest.raises(ValueError, match="WORLD_SIZE='2' is set but RANK is not"):
        settle_placement(placement)


def test_a_default_placement_stands_without_a_group() -> None:
    placement = discover_placement(None, None)
    assert placement.provisional
    assert settle_placement(placement) is None


def test_explicit_arguments_win_over_a_launcher_guess(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert discover_placement(0, 2) == Placement(0, 2, 1, 1, "arguments")


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
