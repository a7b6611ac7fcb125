"""state_dict()/load_state_dict(): resume mid-epoch on the same or another layout."""

from __future__ import annotations

import functools
import hashlib
import json
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

from loader import Loader, steps_per_epoch
from loader.sample import list_images
from tests import pipelines as P

pytestmark = pytest.mark.timeout(180)

TOTAL = 30  # P.sample_source: 30 ids, batch 4


def real_ids(batch: Any) -> list[int]:
    ids = [int(v) for v in batch["id"].ravel()]
    return ids[: len(ids) - batch.info.padded]


def stream(loader: Loader, epochs: int = 1) -> list[list[int]]:
    return [ids for _ in range(epochs) for ids in (real_ids(b) for b in loader)]


def digest(batches: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(batches).encode()).hexdigest()


def make(workers: int = 2, rank: int | None = None, world: int | None = None, **kw: Any) -> Loader:
    kw.setdefault("source", P.sample_source)
    source = kw.pop("source")
    return Loader(
        source,
        P.cast_step,
        batch_size=4,
        num_workers=workers,
        copy=True,
        rank=rank,
        world_size=world,
        **kw,
    )


def take(loader: Loader, count: int) -> tuple[list[list[int]], dict[str, Any]]:
    """``count`` batches of the next epoch, then the state (which must survive JSON)."""
    iterator = iter(loader)
    got = [real_ids(next(iterator)) for _ in range(count)]
    state = json.loads(json.dumps(loader.state_dict()))
    return got, state


def merge(states: list[dict[str, Any]]) -> dict[str, Any]:
    """What a collective state_dict() returns, from one state per rank taken without a group."""
    merged = dict(states[0])
    received = list(states[0]["received"])
    for state in states[1:]:
        for index, value in enumerate(state["received"]):
            if value is not None:
                received[index] = value
    merged["received"] = received
    return merged


@pytest.mark.parametrize("taken", [0, 3, 7])
def test_same_layout_resumes_the_uninterrupted_stream(taken: int) -> None:
    with make() as loader:
        uninterrupted = stream(loader, epochs=2)
    with make() as loader:
        before, state = take(loader, taken)
    assert state["received"] == [(taken + 1) // 2, taken // 2]
    assert len(json.dumps(state)) < 400  # O(shards), not O(samples)
    with make() as loader:
        loader.load_state_dict(state)
        assert loader.epoch == 0
        # len() is the epoch's length, as for torch's DataLoader; the iterator yields the rest
        assert len(loader) == 8
        assert loader.remaining() == 8 - taken
        iterator = iter(loader)
        assert len(iterator) == 8 - taken
        after = [real_ids(b) for b in iterator]
        after += stream(loader, epochs=1)
    assert digest(before + after) == digest(uninterrupted)


def test_a_state_taken_at_an_epochs_end_resumes_with_the_next_epoch() -> None:
    with make() as loader:
        uninterrupted = stream(loader, epochs=3)
    with make() as loader:
        before = stream(loader, epochs=1)
        more, state = take(loader, 8)  # every batch of epoch 1
    # the last batch was handed out: epoch 1 is over, without a next() that says so
    assert state["epoch"] == 2 and state["received"] == [0, 0] and state["steps"] == [0]
    with make() as loader:
        loader.load_state_dict(state)
        assert len(loader) == loader.remaining() == 8
        after = stream(loader)  # epoch 2, whole
        assert [w.traces for w in loader.stats().workers] == [1, 1]
    assert digest(before + more + after) == digest(uninterrupted)


def test_a_state_at_an_epochs_end_in_the_old_form_resumes_with_nothing_left() -> None:
    """A state that says "epoch 1, every batch received" (written before an epoch's end was
    known without a last next()): len() is the whole epoch, nothing of it is left."""
    with make() as loader:
        uninterrupted = stream(loader, epochs=3)
        state = loader.state_dict()
    state = {**state, "epoch": 1, "received": [4, 4]}
    del state["steps"]
    with make() as loader:
        loader.load_state_dict(state)
        assert len(loader) == 8 and loader.remaining() == 0
        assert stream(loader) == []  # what is left of epoch 1: nothing
        after = stream(loader)  # epoch 2, whole
        # the empty epoch traced nothing: one trace per worker, at epoch 2's first step
        assert [w.traces for w in loader.stats().workers] == [1, 1]
    assert digest(after) == digest(uninterrupted[16:])


@pytest.mark.parametrize(
    ("saved", "resumed"), [((2, 2), (1, 3)), ((1, 2), (2, 2)), ((2, 1), (4, 1))]
)
def test_another_layout_delivers_the_rest_of_the_epoch_once(
    saved: tuple[int, int], resumed: tuple[int, int]
) -> None:
    (old_world, old_workers), (new_world, new_workers) = saved, resumed
    consumed: list[int] = []
    states = []
    for rank in range(old_world):
        with make(old_workers, rank, old_world) as loader:
            got, state = take(loader, 3)
            consumed += [i for ids in got for i in ids]
            states.append(state)
    state = merge(states)
    assert None not in state["received"]
    rest: list[int] = []
    steps = set()
    for rank in range(new_world):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with make(new_workers, rank, new_world) as loader:
                loader.load_state_dict(state)
                expected = loader.remaining()
                # the saving ranks had each received 3 batches: len() counts them, and is never
                # shorter than this layout's epochs (a trainer keeps it for the next ones)
                full = steps_per_epoch(TOTAL, new_world * new_workers, 4, False, new_world)
                assert len(loader) == max(full, 3 + expected)
                batches = stream(loader)
                steps.add(len(batches))
                assert len(batches) == expected
                rest += [i for ids in batches for i in ids]
                nxt = stream(loader)  # the next epoch runs on the new layout, complete
                assert len(nxt) == len(loader)
                # a resumed epoch of one step is traced, then every later epoch replays it
                assert [w.traces for w in loader.stats().workers] == [1] * new_workers
        assert not [w for w in caught if "captured" in str(w.message)]
    assert len(steps) == 1, f"ranks took different numbers of steps: {steps}"
    assert sorted(consumed + rest) == list(range(TOTAL))


def test_a_state_taken_without_a_group_resumes_its_own_rank_only() -> None:
    with make(2, 1, 2) as loader:
        _got, state = take(loader, 2)
    assert state["received"][:2] == [None, None]
    with make(2, 1, 2) as loader:
        loader.load_state_dict(state)  # same layout, same rank: fine
    with make(3) as loader, pytest.raises(ValueError, match="describes one rank only"):
        loader.load_state_dict(state)


def test_resume_costs_the_same_at_any_position() -> None:
    """No batch before the position is loaded: 90% in is as fast to start as the beginning."""
    source = functools.partial(P.slow_source, total=120, seconds=0.02)
    times = {}
    for fraction in (0.0, 0.9):
        state = {
            "format": 3,
            "seed": 0,
            "epoch": 0,
            "batch_size": 4,
            "sampling": {"total": 120, "shuffle": True, "drop_last": False},
            "layout": {"world_size": 1, "num_workers": 1},
            "received": [int(30 * fraction)],
            "history": [],
        }
        with make(1, source=source) as loader:
            started = time.monotonic()
            loader.load_state_dict(state)
            next(iter(loader))
            times[fraction] = time.monotonic() - started
    # 27 batches of 4 at 20 ms each would take > 2 s to skip by reading them
    assert times[0.9] <= 1.5 * times[0.0] + 0.3, times


def test_a_state_that_cannot_apply_names_its_field() -> None:
    with make() as loader:
        _got, state = take(loader, 2)
    with make(seed=1) as loader:
        with pytest.raises(ValueError, match=r"^seed: "):
            loader.load_state_dict(state)
        for field, value, match in (
            ("format", 4, "^format: .*newer"),
            ("format", 2, "^format: .*format 2, .*split an epoch into equal parts per worker"),
            ("format", 1, "^format: .*order of samples differs"),
            ("batch_size", 8, "^batch_size: "),
            ("sampling", {"total": 31, "shuffle": True, "drop_last": False}, "sampling.total"),
            ("received", [1], "^received: "),
        ):
            bad = {**state, "seed": 1, field: value}
            with pytest.raises(ValueError, match=match):
                loader.load_state_dict(bad)
        assert len(stream(loader)) == 8  # nothing happened: a fresh epoch 0, complete


def test_a_dali_reader_cannot_be_checkpointed(image_root: Path) -> None:
    with Loader(P.reader(image_root), P.raw_step, batch_size=4, num_workers=1) as loader:
        with pytest.raises(TypeError, match="rule 11") as info:
            loader.state_dict()
    assert "sharded_files" in str(info.value)


def test_sharded_files_read_an_image_folder_exactly_once(image_root: Path) -> None:
    files, labels = list_images(image_root)
    source = functools.partial(P.files_list_source, files=tuple(files))
    with Loader(source, P.bytes_and_label_step, batch_size=4, num_workers=3) as loader:
        assert len(loader) == 12
        for _ in range(2):
            ids = sorted(i for b in loader for i in real_ids(b))
            assert ids == list(range(len(files)))
    folder = functools.partial(P.files_source, root=str(image_root))
    with Loader(folder, P.bytes_and_label_step, batch_size=4, num_workers=2) as loader:
        got = sorted(i for b in loader for i in real_ids(b))
    assert got == sorted(labels)  # class folder labels, every file once


def test_a_worker_killed_during_a_resume_is_replaced_and_counted(tmp_path: Path) -> None:
    """A worker that dies while rebuilding its sources for a loaded state (at the resumed
    epoch's start: load_state_dict() only keeps the state) is replaced; the seek waits for the
    replacement's own position, so len() and the resumed epoch are exact."""
    with make() as loader:
        uninterrupted = stream(loader, epochs=2)
    with make() as loader:
        before, state = take(loader, 3)
    source = functools.partial(P.dying_on_seek_source, marker=str(tmp_path / "died"))
    with make(source=source, max_restarts=1) as loader:
        loader.load_state_dict(state)
        assert (len(loader), loader.remaining()) == (8, 5)  # (computed: nothing started yet)
        assert loader.stats().restarts == 0
        iterator = iter(loader)
        after = [real_ids(next(iterator))]  # the seek: worker 1 dies in it and is replaced
        assert loader.stats().restarts == 1
        assert (len(loader), loader.remaining()) == (8, 4)
        after += [real_ids(b) for b in iterator] + stream(loader)
    assert digest(before + after) == digest(uninterrupted)
