"""Index files (``workers.sources.storage._index_file``): a header and arrays mapped back as
written, partial or foreign files refused, one process at a time under the lock."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from workers.sources.storage import locked, read_index_file, write_index_file

MAGIC = b"TESTIDX1"
ROOT = Path(__file__).resolve().parents[5]


def test_arrays_come_back_as_written_views_of_the_mapping(tmp_path: Path) -> None:
    path = tmp_path / "x.index"
    arrays = [np.arange(5, dtype=np.int64), np.frombuffer(b"abc", np.uint8), np.ones(3, np.int32)]
    write_index_file(path, MAGIC, {"root": "/data", "count": 5}, arrays)
    found = read_index_file(path, MAGIC)
    assert found is not None
    header, read, _mapped = found
    assert header["root"] == "/data" and header["count"] == 5
    assert [a.tolist() for a in read] == [a.tolist() for a in arrays]
    assert [a.dtype for a in read] == [np.dtype("<i8"), np.dtype("u1"), np.dtype("<i4")]
    assert not read[0].flags.writeable  # (a read-only mapping)
    assert not list(tmp_path.glob("*.tmp"))  # (written under a temporary name, renamed)


def test_a_missing_file_is_none_and_a_bad_one_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.index"
    assert read_index_file(path, MAGIC) is None
    write_index_file(path, MAGIC, {}, [np.arange(100, dtype=np.int64)])
    whole = path.read_bytes()
    with pytest.raises(ValueError, match="not an index"):
        read_index_file(path, b"OTHERIDX")
    for broken, why in [
        (whole[:10], "truncated"),
        (whole[:-8], "truncated"),
        (whole + b"\0" * 8, "trailing bytes"),
    ]:
        path.write_bytes(broken)
        with pytest.raises(ValueError, match=why):
            read_index_file(path, MAGIC)


def _try_lock(path: Path) -> bool:
    """Whether another process gets the lock on ``path`` without waiting."""
    code = (
        "import sys; from pathlib import Path; from workers.sources.storage import locked\n"
        "with locked(Path(sys.argv[1]), wait=False) as held: print(held)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip() == "True"


def test_the_lock_is_held_by_one_process_at_a_time(tmp_path: Path) -> None:
    path = tmp_path / "x.lock"
    with locked(path) as held:
        assert held
        assert not _try_lock(path)  # (it does not wait)
    assert _try_lock(path)  # (released on exit)
