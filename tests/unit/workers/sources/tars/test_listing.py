"""The shards' listing: the set of shards checked, each URL split once as the storage splits it."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.sources.storage import _storage
from workers.sources.tars._shards import open_shards


def test_shards_in_two_places_or_listed_twice_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mix local paths and URLs"):
        open_shards(["a.tar", "s3://b/a.tar"], None, 0.0)
    with pytest.raises(ValueError, match=r"listed twice \(a\.tar\)"):
        open_shards(["a.tar", "b.tar", "a.tar"], None, 0.0)
    with pytest.raises(FileNotFoundError):
        open_shards(str(tmp_path / "none.tar"), None, 0.0)


@pytest.mark.parametrize("local", [False, True])
def test_a_shards_directory_and_name_are_worked_out_once_as_the_storage_splits_them(
    local: bool,
) -> None:
    """The start splits each shard's URL once (``places_of``), the same as the storage's own
    ``dirname`` and ``basename``, odd URLs included."""
    from workers.sources.tars._listing import places_of

    remote = [
        "s3://bucket/train-0.tar",
        "s3://bucket/a/b/c/train-1.tar",
        "s3://bucket//doubled.tar",
        "s3://bucket/a//b.tar",
        "s3://top.tar",
        "gs://bucket/dir/",
        "az://bucket/ü nicode/x y.tar",
    ]
    paths = ["/data/train-0.tar", "relative/x.tar", "x.tar", "/data//y.tar", "/z.tar"]
    storage = (
        _storage.LocalStorage() if local else _storage.RemoteStorage.__new__(_storage.RemoteStorage)
    )
    urls = paths if local else remote
    assert places_of(storage, urls) == [(storage.dirname(u), storage.basename(u)) for u in urls]
