"""Tar shards without workers: names, patterns, indexes, epoch orders, storage errors."""

from __future__ import annotations

import io
import logging
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from tests import tar_pipelines as T
from workers import _storage
from workers._tar_index import split_name
from workers._tars import TarOrder, open_shards, parse_ext


def test_brace_patterns_expand_like_webdataset() -> None:
    assert _storage.expand_urls("s3://b/train-{000..002}.tar") == [
        "s3://b/train-000.tar",
        "s3://b/train-001.tar",
        "s3://b/train-002.tar",
    ]
    assert _storage.expand_urls("d/{a,b}-{8..10}.tar") == [
        "d/a-8.tar",
        "d/a-9.tar",
        "d/a-10.tar",
        "d/b-8.tar",
        "d/b-9.tar",
        "d/b-10.tar",
    ]
    with pytest.raises(ValueError, match="first <= last"):
        _storage.expand_urls("t-{5..2}.tar")
    with pytest.raises(ValueError, match="unbalanced"):
        _storage.expand_urls("t-{1..2.tar")
    with pytest.raises(ValueError, match="empty"):
        _storage.expand_urls([])


def test_member_names_split_at_the_first_dot_of_the_file_name() -> None:
    assert split_name("n0144/img.7.jpg") == ("n0144/img", "7.jpg")
    assert split_name("a.b/c.seg.png") == ("a.b/c", "seg.png")
    assert split_name("README") is None
    assert split_name("dir/.hidden") is None
    assert parse_ext(("jpg;png", ".cls")) == [["jpg", "png"], ["cls"]]
    with pytest.raises(ValueError, match="at least one"):
        parse_ext(())


@pytest.mark.parametrize("window", [1, 2, 3, 5])
def test_a_window_order_is_a_permutation_fixed_by_seed_and_epoch(
    tmp_path: Path, window: int
) -> None:
    T.write_id_tars(tmp_path, 30, 7)
    shards = open_shards(str(tmp_path / "train-{000..004}.tar"), None, 0.0)
    assert shards.counts.tolist() == [7, 7, 7, 7, 2]
    positions = np.arange(30)
    order = TarOrder(shards, 1, 9, window).at(positions)
    assert sorted(order.tolist()) == list(range(30))
    assert order.tolist() == TarOrder(shards, 1, 9, window).at(positions).tolist()
    assert order.tolist() != TarOrder(shards, 2, 9, window).at(positions).tolist()
    # positions asked in pieces give the same samples
    pieces = np.concatenate(
        [TarOrder(shards, 1, 9, window).at(p) for p in (positions[:11], positions[11:])]
    )
    assert pieces.tolist() == order.tolist()
    # each group of ``window`` shards is a contiguous run of positions
    shard_of = order // 7
    groups = [set(shard_of[a:b].tolist()) for a, b in _runs(shard_of, window, shards.counts)]
    assert all(len(group) <= window for group in groups)


def _runs(shard_of: np.ndarray, window: int, counts: np.ndarray) -> list[tuple[int, int]]:
    """Split positions where the set of shards would exceed ``window`` (greedy)."""
    runs, start, seen = [], 0, set()
    for position, shard in enumerate(shard_of.tolist()):
        if shard not in seen and len(seen) == window:
            runs.append((start, position))
            start, seen = position, set()
        seen.add(shard)
    runs.append((start, len(shard_of)))
    return runs


def test_an_index_is_kept_reused_and_made_again_when_its_tar_changes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    T.write_id_tars(tmp_path, 14, 7)
    caplog.set_level(logging.INFO, logger="workers")
    first = open_shards(str(tmp_path / "train-{000..001}.tar"), None, 0.0)
    assert sum("indexed" in r.message for r in caplog.records) == 2
    caplog.clear()
    open_shards(str(tmp_path / "train-{000..001}.tar"), None, 0.5)
    assert not [r for r in caplog.records if "indexed" in r.message]
    T.write_id_tars(tmp_path, 10, 5)  # rewritten: 5 samples each now
    again = open_shards(str(tmp_path / "train-{000..001}.tar"), None, 0.0)
    assert again.counts.tolist() == [5, 5] and first.counts.tolist() == [7, 7]
    assert sum("indexed" in r.message for r in caplog.records) == 2


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


def _tar(path: Path, names: list[str]) -> None:
    with tarfile.open(path, "w") as tar:
        for name in names:
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"1"))


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (["a.jpg", "b.jpg", "a.cls"], "key 'a' appears again"),
        (["a.jpg", "a.jpg"], "two members with extension 'jpg'"),
        (["a.jpg", "noext"], "has no extension"),
    ],
)
def test_a_shard_with_bad_members_is_refused_naming_them(
    tmp_path: Path, names: list[str], message: str
) -> None:
    _tar(tmp_path / "bad.tar", names)
    with pytest.raises(ValueError, match=f"bad.tar: .*{message}"):
        open_shards(str(tmp_path / "bad.tar"), None, 0.0)


def test_shards_in_two_places_or_listed_twice_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mix local paths and URLs"):
        open_shards(["a.tar", "s3://b/a.tar"], None, 0.0)
    with pytest.raises(ValueError, match="listed twice"):
        open_shards(["a.tar", "a.tar"], None, 0.0)
    with pytest.raises(FileNotFoundError):
        open_shards(str(tmp_path / "none.tar"), None, 0.0)


def test_transient_errors_are_tried_again_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    assert _storage.transient(ConnectionResetError())
    assert _storage.transient(TimeoutError())
    assert _storage.transient(OSError(os.strerror(104)).__class__(104, "reset"))
    assert not _storage.transient(FileNotFoundError())
    assert not _storage.transient(PermissionError())
    assert not _storage.transient(ValueError("bad"))

    class SlowDown(Exception):  # (botocore names throttling this way)
        pass

    assert _storage.transient(SlowDown())
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
        with pytest.raises(OSError, match=r"reading s3://b/x\.tar failed"):
            storage.retried("reading", "s3://b/x.tar", flaky)
    finally:
        _storage.BACKOFF = previous
    assert sum("trying again" in r.message for r in caplog.records) == 3


def _write_shards(source: Path, target: Path) -> subprocess.CompletedProcess[str]:
    """``python -m loader.tars --from source --to target --samples-per-shard 20``."""
    command = ["--from", str(source), "--to", str(target), "--samples-per-shard", "20"]
    return subprocess.run(
        [sys.executable, "-m", "loader.tars", *command], capture_output=True, text=True
    )


def test_the_command_line_writes_shards_and_refuses_a_missing_folder(
    image_root: Path, tmp_path: Path
) -> None:
    done = _write_shards(image_root, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "wrote 3 shards" in done.stdout and "train-{000000..000002}.tar" in done.stdout
    shards = open_shards(str(tmp_path / "train-{000000..000002}.tar"), None, 0.0)
    assert shards.counts.tolist() == [20, 20, 8]
    failed = _write_shards(tmp_path / "none", tmp_path)
    assert failed.returncode == 2 and "does not exist" in failed.stderr


def test_remote_shards_are_read_one_range_per_shard_not_one_request_per_sample(
    tmp_path: Path,
) -> None:
    """Over fsspec's in-memory filesystem (a remote storage to the loader): an epoch planned
    with ``expect`` reads each shard once, ahead, and every sample comes out right."""
    import fsspec

    from workers._tars import TarLoader, TarOrder

    memory = fsspec.filesystem("memory")
    for path in T.write_id_tars(tmp_path, 30, 7):
        memory.pipe(f"/shards-{os.getpid()}/{path.name}", path.read_bytes())
    try:
        shards = open_shards(f"memory://shards-{os.getpid()}/train-{{000..004}}.tar", None, 0.0)
        assert not shards.storage.local
        loader = TarLoader(shards, parse_ext(("cls", "id")), 1, ["cls", "id"])
        reads: list[tuple[str, int, int]] = []
        read = shards.storage.read

        def counted(path: str, start: int, end: int) -> np.ndarray:
            reads.append((path, start, end))
            return read(path, start, end)

        shards.storage.read = counted  # type: ignore[method-assign]
        ids = TarOrder(shards, 0, 3, 2).at(np.arange(30))
        batches = [ids[k : k + 4] for k in range(0, 30, 4)]
        loader.expect(0, batches)
        for step, batch in enumerate(batches):
            for index in batch.tolist():
                cls, got = loader(index)
                assert int(got[0]) == index and int(cls[0]) == index % 3
            loader.passed(0, step)
        assert sorted(path for path, _start, _end in reads) == sorted(
            f"memory://shards-{os.getpid()}/train-{k:03d}.tar" for k in range(5)
        )
    finally:
        memory.rm(f"/shards-{os.getpid()}", recursive=True)
