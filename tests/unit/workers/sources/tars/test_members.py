"""What a tar sample's outputs are made of: optional members' defaults, ``__key__``/``__url__``."""

from __future__ import annotations

import numpy as np
import pytest

from workers.sources.tars._members import Members, parse_ext


def test_an_optional_member_has_its_default_as_a_present_one_would_be() -> None:
    members = Members(parse_ext(("jpg", "txt", "cls", "__key__")), {"txt": "é", "cls": -1})
    assert members.defaults[1].tobytes() == "é".encode()
    assert members.defaults[2].tolist() == [-1] and members.defaults[2].dtype == np.int32
    assert members.kinds == ["member", "member", "member", "__key__"]


def test_optional_must_name_a_member_of_ext() -> None:
    with pytest.raises(ValueError, match="'json', which is not a member among ext"):
        Members(parse_ext(("jpg", "txt")), {"json": b"{}"})
    with pytest.raises(ValueError, match="not a member"):
        Members(parse_ext(("jpg", "__key__")), {"__key__": b""})
    with pytest.raises(TypeError, match="bytes, a str"):
        Members(parse_ext(("jpg", "txt")), {"txt": 3.5})


def test_outputs_give_members_defaults_key_and_url() -> None:
    members = Members(parse_ext(("txt", "cls", "__key__", "__url__")), {"txt": b"none"})
    data = np.frombuffer(b"xx7", np.uint8)
    made = members.outputs([-1, 102, -1, -1], [-1, 1, -1, -1], data, 100, ("k1", "s/0.tar"), None)  # type: ignore[arg-type]
    assert [m.tobytes() for m in made[:1] + made[2:]] == [b"none", b"k1", b"s/0.tar"]
    assert made[1].tolist() == [7]
