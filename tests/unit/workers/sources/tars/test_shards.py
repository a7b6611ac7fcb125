"""A job's tar shards opened: indexes kept and made again, fingerprints, summaries."""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests import tar_pipelines as T
from workers.sources.tars._reader import parse_ext
from workers.sources.tars._shards import open_shards


def test_an_index_is_kept_reused_and_made_again_when_its_tar_changes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    T.write_id_tars(tmp_path, 14, 7)
    caplog.set_level(logging.INFO, logger="workers")
    first = open_shards(str(tmp_path / "train-{000..001}.tar"), None, 0.0)
    assert sum(r.message.startswith("indexed ") for r in caplog.records) == 2
    caplog.clear()
    open_shards(str(tmp_path / "train-{000..001}.tar"), None, 0.5)
    assert not [r for r in caplog.records if r.message.startswith("indexed ")]
    T.write_id_tars(tmp_path, 10, 5)  # rewritten: 5 samples each now
    again = open_shards(str(tmp_path / "train-{000..001}.tar"), None, 0.0)
    assert again.counts.tolist() == [5, 5] and first.counts.tolist() == [7, 7]
    assert sum(r.message.startswith("indexed ") for r in caplog.records) == 2


def test_the_fingerprint_follows_the_shards_not_where_they_are(tmp_path: Path) -> None:
    T.write_id_tars(tmp_path / "a", 14, 7)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    a = open_shards(str(tmp_path / "a" / "train-{000..001}.tar"), None, 0.0)
    b = open_shards(str(tmp_path / "b" / "train-{000..001}.tar"), None, 0.0)
    assert a.fingerprint() == b.fingerprint()
    T.write_id_tars(tmp_path / "b", 14, 7, skip_cls=frozenset({3}))
    c = open_shards(str(tmp_path / "b" / "train-{000..001}.tar"), None, 0.0)
    assert c.fingerprint() == a.fingerprint()  # the same keys and counts
    T.write_id_tars(tmp_path / "b", 16, 8)
    d = open_shards(str(tmp_path / "b" / "train-{000..001}.tar"), None, 0.0)
    assert d.fingerprint() != a.fingerprint()


def _memory_shards(tmp_path: Path, total: int, per_shard: int) -> tuple[str, object, list[Path]]:
    """Shards in fsspec's in-memory filesystem (a remote store to the loader)."""
    import fsspec

    memory = fsspec.filesystem("memory")
    root = f"/tars-{os.getpid()}-{tmp_path.name}"
    paths = T.write_id_tars(tmp_path / "local", total, per_shard)
    for path in paths:
        memory.pipe(f"{root}/{path.name}", path.read_bytes())
    return f"memory:/{root}", memory, paths


class _Counted:
    """Counts a storage's reads of whole objects (indexes, summaries) and of byte ranges."""

    def __init__(self, storage: object) -> None:
        self.whole: list[str] = []
        self.ranges: list[str] = []
        read_all, read = storage.read_all, storage.read  # type: ignore[attr-defined]

        def counted_all(path: str) -> bytes:
            self.whole.append(path)
            return read_all(path)  # type: ignore[no-any-return]

        def counted(path: str, start: int, end: int, expect: Any = None) -> np.ndarray:
            self.ranges.append(path)
            return read(path, start, end, expect)  # type: ignore[no-any-return]

        storage.read_all, storage.read = counted_all, counted  # type: ignore[attr-defined]
        self.undo = lambda: setattr(storage, "read_all", read_all) or setattr(storage, "read", read)


def test_with_a_summary_a_worker_reads_no_index_until_it_reads_a_shard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from workers.sources.storage import CACHE_DIR_ENV, storage_for
    from workers.sources.tars._summary import SUMMARY

    root, memory, _paths = _memory_shards(tmp_path, 30, 7)
    pattern = f"{root}/train-{{000..004}}.tar"
    try:
        first = open_shards(pattern, None, 0.0, lead=True, publish=True)  # (.idx, summary beside)
        names = sorted(p.rsplit("/", 1)[1] for p in memory.ls(root.split(":/", 1)[1], detail=False))
        assert names == [SUMMARY] + [f"train-{k:03d}.{e}" for k in range(5) for e in ("idx", "tar")]
        monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "fresh-cache"))  # (another node)
        counted = _Counted(storage_for(pattern))
        try:
            again = open_shards(pattern, None, 0.5)
            assert counted.whole == [f"{root}/{SUMMARY}"] and not counted.ranges
            assert again.fingerprint() == first.fingerprint()
            assert again.counts.tolist() == [7, 7, 7, 7, 2]
            # the index of one shard comes when that shard is read, not before
            from workers.sources.tars._reader import TarLoader

            loader = TarLoader(again, parse_ext(("cls", "id")), 1, ["cls", "id"])
            cls, got = loader(int(again.starts[3]) + 1)
            assert int(got[0]) == 22 and int(cls[0]) == 22 % 3
            assert counted.whole[1:] == [f"{root}/train-003.idx"]
        finally:
            counted.undo()
    finally:
        memory.rm(root.split(":/", 1)[1], recursive=True)


def test_a_stale_summary_is_named_and_the_changed_shards_are_read_again(tmp_path: Path) -> None:
    from workers.sources.tars._summary import SUMMARY, decode

    paths = T.write_id_tars(tmp_path, 28, 7)
    pattern = str(tmp_path / "train-{000..003}.tar")
    open_shards(pattern, None, 0.0, lead=True, publish=True)
    T.write_id_tars(tmp_path / "other", 10, 5)  # train-001 rewritten with 5 samples
    shutil.copy(tmp_path / "other" / "train-001.tar", paths[1])
    with pytest.warns(
        UserWarning,
        match=rf"summary {tmp_path}/{SUMMARY} is stale: 1 shard.*"
        r"train-001\.tar \(size 10240 -> 10240\)|train-001\.tar \(mtime",
    ):
        changed = open_shards(pattern, None, 0.0, lead=True, publish=True)
    assert changed.counts.tolist() == [7, 5, 7, 7]
    entries = decode((tmp_path / SUMMARY).read_bytes(), SUMMARY)
    assert entries["train-001.tar"].samples == 5  # rewritten by the lead worker
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert open_shards(pattern, None, 0.0, lead=True).counts.tolist() == [7, 5, 7, 7]
    # a shard the summary does not cover is opened from its own index; a missing one is named
    T.write_id_tars(tmp_path / "more", 35, 7)
    shutil.copy(tmp_path / "more" / "train-004.tar", tmp_path / "train-004.tar")
    five = open_shards(str(tmp_path / "train-{000..004}.tar"), None, 0.0, lead=True)
    assert five.counts.tolist() == [7, 5, 7, 7, 7]
    (tmp_path / "train-002.tar").unlink()
    with pytest.raises(FileNotFoundError, match=r"train-002\.tar"):
        open_shards(str(tmp_path / "train-{000..004}.tar"), None, 0.0)
