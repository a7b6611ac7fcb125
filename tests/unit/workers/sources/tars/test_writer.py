"""``python -m loader.tars write``: shards written with their indexes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests import tar_pipelines as T
from workers.sources.tars._shards import open_shards


def _write_shards(source: Path, target: Path, *command: str) -> subprocess.CompletedProcess[str]:
    """``python -m loader.tars [command] --from source --to target --samples-per-shard 20``."""
    arguments = [*command, "--from", str(source), "--to", str(target), "--samples-per-shard", "20"]
    return subprocess.run(
        [sys.executable, "-m", "loader.tars", *arguments], capture_output=True, text=True
    )


@pytest.mark.parametrize("command", [(), ("write",)], ids=["no-command", "write"])
def test_the_command_line_writes_shards_with_indexes_and_refuses_a_missing_folder(
    image_root: Path, tmp_path: Path, command: tuple[str, ...]
) -> None:
    from workers.sources.tars._summary import SUMMARY, decode

    done = _write_shards(image_root, tmp_path, *command)
    assert done.returncode == 0, done.stderr
    assert "wrote 3 shards" in done.stdout and "train-{000000..000002}.tar" in done.stdout
    for k in range(3):  # each shard's index beside it, as DALI's tool writes it
        tar = tmp_path / f"train-{k:06d}.tar"
        assert tar.with_suffix(".idx").read_bytes() == T.wds2idx(tar, tmp_path / "theirs.idx")
    summary = decode((tmp_path / SUMMARY).read_bytes(), SUMMARY)
    assert [e.samples for _name, e in sorted(summary.items())] == [20, 20, 8]
    shards = open_shards(str(tmp_path / "train-{000000..000002}.tar"), None, 0.0)
    assert shards.counts.tolist() == [20, 20, 8]
    failed = _write_shards(tmp_path / "none", tmp_path, *command)
    assert failed.returncode == 2 and "does not exist" in failed.stderr
