"""The worker server's collection-free imports (:func:`workers.server._frozen_after`)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from workers import server


@pytest.fixture
def unfrozen() -> Iterator[None]:
    yield
    gc.unfreeze()
    gc.enable()


@pytest.mark.usefixtures("unfrozen")
def test_no_collection_while_it_runs_then_everything_frozen_and_collection_back_on() -> None:
    gc.enable()
    before = gc.get_freeze_count()
    with server._frozen_after():
        assert not gc.isenabled()
        made = [[i] for i in range(1000)]
    assert gc.isenabled()
    assert gc.get_freeze_count() >= before + len(made)


@pytest.mark.usefixtures("unfrozen")
def test_collection_left_off_when_it_was_off_and_on_after_a_failure() -> None:
    gc.disable()
    with server._frozen_after():
        pass
    assert not gc.isenabled()
    gc.enable()
    with pytest.raises(ZeroDivisionError), server._frozen_after():
        1 / 0  # noqa: B018
    assert gc.isenabled()
