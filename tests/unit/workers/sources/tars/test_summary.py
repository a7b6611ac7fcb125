"""A directory's summary of its shards (``workers.sources.tars._summary``): written and read back,
bad ones refused naming where they are, entries of other shard sets kept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workers.sources.storage import CACHE_DIR_ENV, storage_for
from workers.sources.tars._summary import (
    SUMMARY,
    ShardEntry,
    decode,
    describe_stale,
    encode,
    read_summary,
    stale_reason,
    updated,
    write_summary,
)

ENTRIES = {
    "b.tar": ShardEntry(2048, "mtime:2", 7, "k2"),
    "a.tar": ShardEntry(1024, "mtime:1", 5, "k1"),
}


def test_a_summary_comes_back_as_written_its_shards_sorted() -> None:
    data = encode(ENTRIES)
    assert decode(data, "here") == ENTRIES
    document = json.loads(data)
    assert [row[0] for row in document["shards"]] == ["a.tar", "b.tar"]
    assert document["samples"] == 12


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"{not json", "is not JSON"),
        (b'{"format": "other"}', "is not a"),
        (encode(ENTRIES).replace(b'"version":', b'"version":9,"old":'), "of version"),
        (encode(ENTRIES).replace(b'"a.tar",1024', b'"a.tar","x"'), "malformed shard entry"),
    ],
)
def test_a_bad_summary_is_refused_naming_where_it_is(data: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why) as raised:
        decode(data, "s3://b/loader-summary.json")
    assert "s3://b/loader-summary.json" in str(raised.value)


def test_an_update_keeps_the_entries_of_shards_still_listed_as_they_were() -> None:
    listing = {"a.tar": (1024, "mtime:1"), "b.tar": (9999, "mtime:3")}
    new = {"c.tar": ShardEntry(10, "mtime:4", 1, "k3")}
    assert updated(ENTRIES, new, listing) == {"a.tar": ENTRIES["a.tar"], **new}
    assert updated(ENTRIES, new, None) == new  # (no listing: nothing old is vouched for)


def test_a_summary_is_written_beside_the_shards_and_read_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    storage = storage_for(str(tmp_path))
    where = write_summary(storage, str(tmp_path), ENTRIES, beside=True)
    assert where == str(tmp_path / SUMMARY)
    found = read_summary(storage, str(tmp_path), None)
    assert found == (ENTRIES, where)
    assert read_summary(storage, str(tmp_path), {"other.tar": (1, "x")}) is None  # not listed


def test_a_summary_the_store_refuses_is_kept_in_this_nodes_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    (tmp_path / SUMMARY).mkdir()  # (its name taken: the store refuses the write, even to root)
    storage = storage_for(str(tmp_path))
    where = write_summary(storage, str(tmp_path), ENTRIES, beside=True)
    assert where.startswith(str(tmp_path / "cache" / "tar-index"))
    assert read_summary(storage, str(tmp_path), None) == (ENTRIES, where)


def test_a_stale_entry_says_what_changed() -> None:
    entry = ShardEntry(1024, "etag:a", 5, "k")
    assert stale_reason(entry, (1000, "etag:a")) == "size 1024 -> 1000"
    assert stale_reason(entry, (1024, "etag:b")) == "etag:a -> etag:b"
    stale = [(f"{k}.tar", "size 1 -> 2") for k in range(7)]
    said = describe_stale(stale, limit=2)
    assert said == "0.tar (size 1 -> 2), 1.tar (size 1 -> 2) and 5 more"


def test_a_jobs_summary_goes_to_this_nodes_cache_and_is_read_after_the_one_beside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    storage = storage_for(str(tmp_path))
    where = write_summary(storage, str(tmp_path), ENTRIES, beside=False)
    assert where.startswith(str(tmp_path / "cache" / "tar-index"))
    assert not (tmp_path / SUMMARY).exists()
    assert read_summary(storage, str(tmp_path), None) == (ENTRIES, where)
    beside = {"a.tar": ShardEntry(10, "mtime:9", 3, "k9")}
    published = write_summary(storage, str(tmp_path), beside, beside=True)
    assert read_summary(storage, str(tmp_path), None) == ({**ENTRIES, **beside}, published)


def test_the_cache_names_a_remote_object_with_its_endpoint() -> None:
    from workers.sources.storage._storage import RemoteStorage
    from workers.sources.tars._index import cache_path
    from workers.sources.tars._summary import cached_summary_path

    # (only the endpoint names a remote object in the cache: no client is made here, whose
    # event loop would outlive the test)
    one, other = RemoteStorage.__new__(RemoteStorage), RemoteStorage.__new__(RemoteStorage)
    one.endpoint, other.endpoint = "http://127.0.0.1:1", "http://127.0.0.1:2"
    assert cache_path(one, "s3://b/x.tar") != cache_path(other, "s3://b/x.tar")
    assert cached_summary_path(one, "s3://b") != cached_summary_path(other, "s3://b")
    assert cache_path(one, "s3://b/x.tar") != cache_path(one, "s3://b/y.tar")
