"""A failed ``load``'s kind is told by the exception where it is raised: the skip-limit error's
kinds never come from reading the error's words."""

from __future__ import annotations

import pickle

from ipc import wire
from workers.sources import ImageTooLargeError
from workers.sources.plan import MemberMissing, SampleLeftOut, load_skip


def test_each_kind_of_load_failure_is_told_by_its_exception() -> None:
    missing = load_skip(3, MemberMissing("s/0.tar: sample '7' has no .txt member", "txt"))
    assert (missing.index, missing.kind, missing.member) == (3, wire.MEMBER_MISSING, "txt")
    assert missing.reason.startswith("load raised MemberMissing: s/0.tar")
    lost = load_skip(4, SampleLeftOut("s3://b/t.tar: sample 'k' is left out", "s3://b/t.tar", 4))
    assert lost.kind == wire.LOAD_FAILED and lost.left_out == (
        "s3://b/t.tar was truncated since it was indexed: its first 4 samples are read; the "
        "rest of it is left out"
    )
    assert load_skip(5, ImageTooLargeError("a.png: too large")).kind == wire.UNDECODABLE
    # (words that once made a guess say nothing now: an OSError mentioning an image)
    other = load_skip(6, OSError("image.jpg: decoding marker truncated"))
    assert (other.kind, other.member, other.left_out) == (wire.LOAD_FAILED, "", "")


def test_the_exceptions_keep_what_they_tell_through_pickling() -> None:
    """An error raised (under ``on_error="raise"``) travels to the trainer pickled."""
    missing = pickle.loads(pickle.dumps(MemberMissing("no .txt", "txt")))
    assert (str(missing), missing.member) == ("no .txt", "txt")
    lost = pickle.loads(pickle.dumps(SampleLeftOut("left out", "s/t.tar", 2)))
    assert (lost.shard, lost.whole) == ("s/t.tar", 2)
