"""Storage without workers: URL patterns, retries of transient errors."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from workers.sources.storage import _failures, _storage, expand_urls


def test_brace_patterns_expand_like_webdataset(tmp_path: Path) -> None:
    assert expand_urls("s3://b/train-{000..002}.tar") == [
        "s3://b/train-000.tar",
        "s3://b/train-001.tar",
        "s3://b/train-002.tar",
    ]
    assert expand_urls("d/{a,b}-{8..10}.tar") == [
        "d/a-8.tar",
        "d/a-9.tar",
        "d/a-10.tar",
        "d/b-8.tar",
        "d/b-9.tar",
        "d/b-10.tar",
    ]
    with pytest.raises(ValueError, match="first <= last"):
        expand_urls("t-{5..2}.tar")
    with pytest.raises(ValueError, match="unbalanced"):
        expand_urls("t-{1..2.tar")
    with pytest.raises(ValueError, match="empty"):
        expand_urls([])
    # (a local name that exists as written is not a pattern)
    (tmp_path / "d{1,2}").mkdir()
    assert expand_urls(str(tmp_path / "d{1,2}")) == [str(tmp_path / "d{1,2}")]
    assert expand_urls(str(tmp_path / "e{1,2}")) == [str(tmp_path / "e1"), str(tmp_path / "e2")]


def test_transient_errors_are_tried_again_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    assert _failures.transient(ConnectionResetError())
    assert _failures.transient(TimeoutError())
    assert _failures.transient(OSError(os.strerror(104)).__class__(104, "reset"))
    assert not _failures.transient(FileNotFoundError())
    assert not _failures.transient(PermissionError())
    assert not _failures.transient(ValueError("bad"))

    class SlowDown(Exception):  # (botocore names throttling this way)
        pass

    assert _failures.transient(SlowDown())
    storage = _storage.RemoteStorage.__new__(_storage.RemoteStorage)
    storage.retries = 2
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError(104, "reset by peer")
        return "data"

    caplog.set_level(logging.WARNING, logger="workers")
    previous, _storage.BACKOFF = _storage.BACKOFF, 0.001
    try:
        assert storage.retried("reading", "s3://b/x.tar", flaky) == "data"
        calls.clear()
        storage.retries = 1
        with pytest.raises(OSError, match=r"^s3://b/x\.tar: reading failed: ConnectionResetError"):
            storage.retried("reading", "s3://b/x.tar", flaky)
    finally:
        _storage.BACKOFF = previous
    assert sum("trying again" in r.message for r in caplog.records) == 3


def test_a_hub_entrys_version_is_its_lfs_hash_else_its_blob_id() -> None:
    hub = pytest.importorskip("huggingface_hub.hf_api")
    lfs = hub.BlobLfsInfo(size=10, sha256="ab" * 32, pointer_size=134)
    entry = {"name": "datasets/a/b@v1/x.parquet", "size": 10, "type": "file", "blob_id": "c1"}
    assert _storage._version({**entry, "lfs": lfs}) == f"sha256:{'ab' * 32}"
    assert _storage._version({**entry, "lfs": None}) == "blob_id:c1"
    assert _storage._version({"ETag": '"e1"', "LastModified": "t"}) == "ETag:e1"
    assert _storage._version({"mtime": 5.0}) == "mtime:5.0"
