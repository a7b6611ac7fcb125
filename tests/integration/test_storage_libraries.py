"""A storage library older than the extras allow (s3fs 0.4.2, what pip resolves beside a recent
boto3) is named once, before any worker starts: by the trainer's Loader over ``s3://`` and by
``python -m loader.tars index``, with the version found, the version needed and the command that
installs them. A real old s3fs, installed from the package index into a folder put first on
``PYTHONPATH``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
OLD = "0.4.2"
MESSAGE = (
    f"reading s3:// URLs needs s3fs>=2023.6; s3fs {OLD} is installed (older than the loader's "
    'extras allow): pip install "dali-capture-loader[s3]"'
)

TRAINER = """
import functools
from loader import Loader
from tests import tar_pipelines as T

def source(shard):  # (the URL only in the function's code)
    return T.id_tars(shard, "s3://bucket/train-{000..002}.tar", storage_options=OPTIONS)

OPTIONS = {"endpoint_url": "http://127.0.0.1:9"}

if __name__ == "__main__":
    import sys
    kind = sys.argv[1]
    if kind == "partial":
        chosen = functools.partial(T.id_tars, urls="s3://bucket/train-{000..002}.tar",
                                   storage_options=OPTIONS)
    else:
        chosen = source
    with Loader(chosen, T.cls_id_step, batch_size=4, num_workers=2) as loader:
        next(iter(loader))
"""


@pytest.fixture(scope="module")
def old_s3fs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("old-s3fs")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--quiet",
            "--target",
            str(target),
            f"s3fs=={OLD}",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    if done.returncode != 0 or not (target / "s3fs").is_dir():
        pytest.skip(f"s3fs=={OLD} cannot be installed here: {done.stderr.strip()[-300:]}")
    return target


def _run(old: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DALI_LOADER_")}
    env["PYTHONPATH"] = os.pathsep.join([str(old), str(ROOT)])
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env
    )


@pytest.mark.parametrize("kind", ["partial", "function"])
def test_a_loader_over_s3_names_an_old_s3fs_once_before_any_worker(
    old_s3fs: Path, tmp_path: Path, kind: str
) -> None:
    """(Before: every worker stopped with ``TypeError: Session.__init__() got an unexpected
    keyword argument 'endpoint_url' [worker 0, ...]``.)"""
    script = tmp_path / "train.py"
    script.write_text(TRAINER)
    done = _run(old_s3fs, tmp_path, str(script), kind)
    assert done.returncode != 0
    assert done.stderr.count(MESSAGE) == 1, done.stderr[-3000:]
    assert "StorageLibraryError" in done.stderr and "ImportError" not in done.stderr.replace(
        "StorageLibraryError", ""
    ), done.stderr[-3000:]
    assert "[worker" not in done.stderr and "TypeError" not in done.stderr, done.stderr[-3000:]


def test_the_index_command_names_an_old_s3fs_once(old_s3fs: Path, tmp_path: Path) -> None:
    """(Before: a bare traceback.)"""
    done = _run(old_s3fs, tmp_path, "-m", "loader.tars", "index", "s3://bucket/t-{0..3}.tar")
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.strip() == f"error: {MESSAGE}", done.stderr
    assert "Traceback" not in done.stderr
