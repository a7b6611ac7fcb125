"""Finding or making a shard's index at run time (``workers.sources.tars._indexer``): a scan
written beside the shard, then this node's cache, then the ``.idx``; a forced scan."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import tar_pipelines as T
from workers.sources.storage import CACHE_DIR_ENV, storage_for
from workers.sources.tars._indexer import Indexer, index_command


def test_a_shard_is_scanned_once_then_found_in_the_cache_then_beside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    (tar,) = T.write_id_tars(tmp_path / "data", 6, 6)
    storage = storage_for(str(tar))
    identity = storage.identity(str(tar))
    indexer = Indexer(storage, publish=True)
    found = indexer.get(str(tar), identity, listed=False)
    assert found is not None
    index, source = found
    assert source == "scan" and index.samples == 6 and indexer.scanned == 1
    assert tar.with_suffix(".idx").exists()  # (written beside the shard: asked to publish)
    again = Indexer(storage).get(str(tar), identity)
    assert again is not None and again[1] == "cache" and again[0].keys_hash == index.keys_hash
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "another-node"))
    beside = Indexer(storage).get(str(tar), identity)
    assert beside is not None and beside[1] == "idx" and beside[0].samples == 6
    forced = Indexer(storage).get(str(tar), identity, force=True)
    assert forced is not None and forced[1] == "scan"


def test_without_a_scan_a_shard_with_no_index_is_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    (tar,) = T.write_id_tars(tmp_path, 4, 4)
    storage = storage_for(str(tar))
    indexer = Indexer(storage)
    assert indexer.get(str(tar), storage.identity(str(tar)), listed=False, scan=False) is None
    assert indexer.scanned == 0


def test_the_index_command_is_named_for_a_pattern_or_a_list() -> None:
    assert (
        index_command("s3://b/train-{0..9}.tar")
        == "python -m loader.tars index 's3://b/train-{0..9}.tar'"
    )
    said = index_command([f"{k}.tar" for k in range(5)], force=True)
    assert said == "python -m loader.tars index '0.tar 1.tar 2.tar ...' --force"


def test_a_job_keeps_the_index_it_makes_in_this_nodes_cache_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    (tar,) = T.write_id_tars(tmp_path / "data", 6, 6)
    storage = storage_for(str(tar))
    identity = storage.identity(str(tar))
    found = Indexer(storage).get(str(tar), identity, listed=False)
    assert found is not None and found[1] == "scan"
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == [tar.name]  # (nothing beside)
    again = Indexer(storage).get(str(tar), identity, listed=False)
    assert again is not None and again[1] == "cache"
