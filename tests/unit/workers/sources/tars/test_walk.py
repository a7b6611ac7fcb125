"""The walk that finds or makes the shards' indexes at a start (``workers.sources.tars._walk``):
each worker from its own place, every shard once, the progress told to the trainer."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import tar_pipelines as T
from workers.sources.plan import REPORT_PROGRESS
from workers.sources.storage import CACHE_DIR_ENV, storage_for
from workers.sources.tars._indexer import Indexer
from workers.sources.tars._listing import list_shards
from workers.sources.tars._walk import WalkProgress, walk


@pytest.mark.parametrize("start", [0, 2])
def test_a_walk_opens_every_shard_once_from_its_own_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, start: int
) -> None:
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    urls = [str(p) for p in T.write_id_tars(tmp_path, 16, 4)]
    storage = storage_for(urls[0])
    listed = list_shards(storage, urls)
    indexer = Indexer(storage)
    told: list[tuple[str, int, int]] = []
    token = REPORT_PROGRESS.set(
        lambda doing, done, count, _seconds: told.append((doing, done, count))
    )
    try:
        progress = WalkProgress(4, 4, indexer, False, "the index command")
        opened: list[tuple[int, int]] = []
        walk(
            urls,
            listed,
            indexer,
            [0, 1, 2, 3],
            start,
            lambda k, i: opened.append((k, i.samples)),
            progress,
        )
    finally:
        REPORT_PROGRESS.reset(token)
    assert [k for k, _ in opened] == [(start + k) % 4 for k in range(4)]
    assert all(samples == 4 for _, samples in opened) and progress.done == 4
    assert indexer.scanned == 4
    assert told and told[0] == ("indexing 4 tar shards (4 without an index: scanned)", 0, 4)
