"""``python -m loader.tars index``: a dataset indexed once, an interrupted run finished."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests import tar_pipelines as T


def test_small_shards_indexes_are_kept_in_the_summary_not_beside_them(tmp_path: Path) -> None:
    """Shards of 5 samples: their indexes go into the summary (no ``.idx`` written), a second
    run finds them up to date, and ``--idx-files`` writes the files (from this node's cache)
    and takes them out of the summary."""
    from workers.sources.storage import CACHE_DIR_ENV
    from workers.sources.tars._summary import SUMMARY, decode
    from workers.sources.tars._wds_idx import parse_idx

    paths = T.write_id_tars(tmp_path, 40, 5)
    pattern = str(tmp_path / "train-{000..007}.tar")
    env = dict(os.environ, **{CACHE_DIR_ENV: str(tmp_path / "cache")})

    def index(*extra: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "loader.tars", "index", pattern, "--workers", "2"]
        return subprocess.run([*command, *extra], capture_output=True, text=True, env=env)

    done = index()
    assert done.returncode == 0, done.stderr
    assert "8 of 8 shards indexed" in done.stdout and "8 small shards' indexes" in done.stdout
    assert not list(tmp_path.glob("*.idx"))
    entries = decode((tmp_path / SUMMARY).read_bytes(), "s")
    for path in paths:
        entry = entries[path.name]
        index_of = parse_idx(str(path), "s", entry.idx.encode())
        assert index_of.samples == entry.samples == 5 and index_of.keys_hash == entry.keys
    again = index()
    assert "scanned 0" in again.stdout and "8 up to date" in again.stdout, again.stdout
    files = index("--idx-files")
    assert "scanned 0" in files.stdout and "8 from this node's cache" in files.stdout
    assert len(list(tmp_path.glob("*.idx"))) == 8
    assert not any(e.idx for e in decode((tmp_path / SUMMARY).read_bytes(), "s").values())


def test_the_index_command_indexes_once_and_finishes_an_interrupted_run(tmp_path: Path) -> None:
    from workers.sources.storage import CACHE_DIR_ENV
    from workers.sources.tars._summary import SUMMARY, decode

    T.write_id_tars(tmp_path, 40, 5)
    pattern = str(tmp_path / "train-{000..007}.tar")

    def index(cache: str | None = None) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "loader.tars", "index", pattern, "--workers", "2"]
        env = dict(os.environ, **({CACHE_DIR_ENV: cache} if cache else {}))
        return subprocess.run([*command, "--idx-files"], capture_output=True, text=True, env=env)

    done = index()
    assert done.returncode == 0, done.stderr
    assert "[8/8] 100.0%  scanned 8" in done.stdout and "8 of 8 shards indexed" in done.stdout
    assert sorted(p.name for p in tmp_path.glob("*.idx")) == [
        f"train-{k:03d}.idx" for k in range(8)
    ]
    assert sum(e.samples for e in decode((tmp_path / SUMMARY).read_bytes(), "s").values()) == 40
    again = index()
    assert "scanned 0" in again.stdout and "8 up to date" in again.stdout
    # an interrupted run: 3 indexes missing, the summary gone: 3 scans, 5 indexes read
    for k in (1, 4, 6):
        (tmp_path / f"train-{k:03d}.idx").unlink()
    (tmp_path / SUMMARY).unlink()
    finished = index(cache=str(tmp_path / "another-node"))
    assert "scanned 3" in finished.stdout and "read 5 .idx" in finished.stdout, finished.stdout
    assert len(decode((tmp_path / SUMMARY).read_bytes(), "s")) == 8
    # on the node that made them, missing indexes come from its cache, not from a scan
    (tmp_path / "train-002.idx").unlink()
    cached = index()
    assert "scanned 0" in cached.stdout and "1 from this node's cache" in cached.stdout
    assert (tmp_path / "train-002.idx").exists()
    bad = subprocess.run(
        [sys.executable, "-m", "loader.tars", "index", pattern, "--storage-options", "{x"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "--storage-options is not JSON" in bad.stderr
