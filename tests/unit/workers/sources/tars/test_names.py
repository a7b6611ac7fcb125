"""The shards a job's URLs name: directories and globs give their ``*.tar`` files only."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.sources.tars._names import shard_names


def test_a_directory_or_glob_gives_its_tars_in_name_order_and_never_a_sidecar(
    tmp_path: Path,
) -> None:
    for name in (
        "00001.tar",
        "00000.tar",
        "00000.parquet",
        "00000_stats.json",
        "00000.idx",
        "loader-summary.json",
    ):
        (tmp_path / name).write_bytes(b"x")
    tars = [str(tmp_path / "00000.tar"), str(tmp_path / "00001.tar")]
    assert shard_names(str(tmp_path)) == tars
    assert shard_names(tmp_path) == tars
    assert shard_names(str(tmp_path / "*")) == tars
    assert shard_names([str(tmp_path / "0000{0,1}.tar")]) == tars


def test_a_directory_without_tars_says_what_it_holds(tmp_path: Path) -> None:
    (tmp_path / "a.parquet").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match=r"no \*\.tar shard in the directory .*\.parquet"):
        shard_names(str(tmp_path))
