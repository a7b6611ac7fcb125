"""A dataset's parts as a state records them (``workers.sources.plan._parts``), and what a
refused state says differs."""

from __future__ import annotations

import pytest

from workers.sources.plan import decode_parts, describe_difference, encode_parts


def test_parts_come_back_as_encoded() -> None:
    parts = [("train-000000.tar", 81920, 100), ("train-000001.tar", 40960, 50)]
    kind, decoded = decode_parts(encode_parts("shard", parts))
    assert kind == "shard" and decoded == parts


@pytest.mark.parametrize("text", ["", "not base64!", "aGVsbG8="])
def test_a_string_that_holds_no_parts_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not a list of a dataset's parts"):
        decode_parts(text)


def test_the_difference_names_the_parts_missing_added_and_changed() -> None:
    saved = encode_parts("shard", [("a.tar", 10, 1), ("b.tar", 20, 2), ("c.tar", 30, 3)])
    mine = encode_parts("shard", [("a.tar", 10, 1), ("b.tar", 21, 2), ("d.tar", 40, 4)])
    said = describe_difference(saved, mine)
    assert said == (
        "shards missing here: c.tar; shards not in the state: d.tar; "
        "shards changed: b.tar (size 20 -> 21)"
    )


def test_no_difference_is_said_where_there_is_none_to_say() -> None:
    same = encode_parts("class folder", [("cat", 10, 1)])
    assert describe_difference(same, same) is None
    assert describe_difference(same, encode_parts("shard", [("cat", 11, 1)])) is None
    assert describe_difference("", same) is None


def test_a_long_list_is_cut_after_a_few_names() -> None:
    saved = encode_parts("shard", [(f"{k}.tar", 1, 1) for k in range(8)])
    said = describe_difference(saved, encode_parts("shard", []))
    assert said == "shards missing here: 0.tar, 1.tar, 2.tar, 3.tar, 4.tar and 3 more"


def test_the_same_parts_in_another_order_are_named() -> None:
    parts = [("a.parquet", 10, 3), ("b.parquet", 20, 4), ("c.parquet", 30, 5)]
    saved = encode_parts("file", parts)
    mine = encode_parts("file", [parts[0], parts[2], parts[1]])
    said = describe_difference(saved, mine)
    assert said is not None
    assert "the same files in another order (file 1 was b.parquet, is c.parquet here)" in said
