"""The state's format 3 (no processes): a layout's batches shared out per rank, ``history`` by
world size, and what a format 2 state can still do."""

from __future__ import annotations

from typing import Any

import pytest

from loader.run._checkpoint import FORMAT, parse_state
from workers import Sampling, plan_epoch

SAMPLING = Sampling(80, 16, 0, True, False)


def _state(**fields: Any) -> dict[str, Any]:
    state: dict[str, Any] = {
        "format": FORMAT,
        "seed": 0,
        "epoch": 1,
        "batch_size": 16,
        "sampling": {"total": 80, "shuffle": True, "drop_last": False, "fingerprint": ""},
        "layout": {"world_size": 1, "num_workers": 4},
        "received": [1, 1, 0, 0],
        "history": [],
        "steps": [2],
    }
    return {**state, **fields}


def _parse(state: dict[str, Any], world_size: int = 1, num_workers: int = 4) -> Any:
    return parse_state(
        state, sampling=SAMPLING, world_size=world_size, num_workers=num_workers, rank=0
    )


def test_a_state_counts_uneven_workers_and_refuses_a_count_past_a_shard_s_batches() -> None:
    # 80 samples, batches of 16, 4 workers on one rank: 5 batches, shared 1, 1, 1, 2
    assert [len(shard) for shard in plan_epoch(SAMPLING, 1, 4, None)] == [1, 1, 1, 2]
    resume = _parse(_state(received=[1, 1, 0, 2]))
    assert resume.position.segments == ((1, (1, 1, 0, 2)),) and resume.continues
    with pytest.raises(ValueError, match=r"received: shard 1 of 4 \(on 1 rank\(s\)\) .* 2 "):
        _parse(_state(received=[0, 2, 0, 0]))


def test_history_names_each_earlier_layout_by_its_world_size() -> None:
    history = [[2, [1, 0, 1, 0]]]  # 2 ranks of 2 workers
    resume = _parse(_state(history=history), world_size=2, num_workers=2)
    assert resume.position.segments[0] == (2, (1, 0, 1, 0))
    with pytest.raises(ValueError, match=r"history: .* same number per rank of 3"):
        _parse(_state(history=[[3, [1, 0, 1, 0]]]))


def test_a_format_2_state_loads_at_an_epoch_start_and_is_refused_mid_epoch() -> None:
    fresh = _parse(_state(format=2, received=[0, 0, 0, 0], steps=[0]))
    assert fresh.epoch == 1 and fresh.before == 0
    with pytest.raises(ValueError, match=r"format 2, .*equal parts per worker.*start the epoch"):
        _parse(_state(format=2))


def test_a_datasets_parts_name_what_differs_and_stay_small() -> None:
    from workers.sources.plan._parts import decode_parts, describe_difference, encode_parts

    shards = [(f"train-{k:06d}.tar", 81920 + k % 7, 1251) for k in range(8192)]
    saved = encode_parts("shard", shards)
    assert decode_parts(saved) == ("shard", shards)
    assert len(saved) < 96 * 1024  # (8,192 shards in a state: under 96 KiB)
    assert describe_difference(saved, saved) is None
    changed = list(shards)
    del changed[7]
    changed[9] = (changed[9][0], 80000, 1250)  # (train-000010: 7 is gone)
    changed += [(f"train-{k:06d}.tar", 1, 1) for k in range(8192, 8200)]
    said = describe_difference(saved, encode_parts("shard", changed))
    assert said == (
        "shards missing here: train-000007.tar; shards not in the state: train-008192.tar, "
        "train-008193.tar, train-008194.tar, train-008195.tar, train-008196.tar and 3 more; "
        "shards changed: train-000010.tar (samples 1251 -> 1250, size 81923 -> 80000)"
    )
    # other kinds, or no parts: nothing to say
    assert describe_difference(saved, encode_parts("class folder", [("a", 1, 1)])) is None
    assert describe_difference("", saved) is None
    with pytest.raises(ValueError, match="not a list of a dataset's parts"):
        decode_parts("bm90IGpzb24=")


def test_another_shuffle_window_is_refused_naming_it_also_without_strict() -> None:
    """The window orders the epoch: a state resumed under another one delivered other samples
    than those it owed (68 twice and 68 never, over 387 rows). It was refused as other data,
    with advice (strict=False) that then resumed wrongly."""
    import dataclasses

    def parse(saved: str, mine: str, *, strict: bool, shuffle: bool = True) -> Any:
        state = _state(sampling={**_state()["sampling"], "fingerprint": saved})
        sampling = dataclasses.replace(SAMPLING, fingerprint=mine, shuffle=shuffle)
        return parse_state(
            state, sampling=sampling, world_size=1, num_workers=4, rank=0, strict=strict
        )

    for strict in (True, False):
        with pytest.raises(ValueError, match=r"shuffle_window=5 \(this loader's source has 1\)"):
            parse("parquet:ab12+window5", "parquet:ab12+window1", strict=strict)
    assert parse("parquet:ab12+window5", "parquet:ab12+window5", strict=True).epoch == 1
    # not shuffled here: the shuffle is named, not the window or the data
    with pytest.raises(ValueError, match=r"sampling\.shuffle: the state was taken with shuffle="):
        parse("parquet:ab12+window5", "parquet:ab12", strict=True, shuffle=False)
    # other data too: the data is named, as before
    with pytest.raises(ValueError, match=r"dataset: the state was saved over"):
        parse("parquet:ab12+window5", "parquet:cd34+window1", strict=True)
