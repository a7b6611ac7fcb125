"""The package as users receive it: the sdist and the wheel built from this tree (the wheel from
the sdist, as ``python -m build`` and pip do) carry every module and data file of ``loader/``,
``workers/`` and ``ipc/``, sub-packages included, and nothing of ``bench/``, ``tests/`` or
``examples/``. (``.ci/wheel_smoke.sh`` installs them into a fresh venv and runs them.)"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("loader", "workers", "ipc")

pytestmark = pytest.mark.timeout(300)


def _tree_files() -> list[str]:
    """The repository's files as git sees them (tracked, or new and not ignored)."""
    if shutil.which("git") and (ROOT / ".git").exists():
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
        return [name for name in listed if (ROOT / name).is_file()]
    ignored = {"__pycache__", ".git", ".ci", ".venv", "build", "dist"}
    return [
        str(path.relative_to(ROOT))
        for path in ROOT.rglob("*")
        if path.is_file() and not ignored & set(path.relative_to(ROOT).parts)
    ]


def _package_files(files: list[str]) -> set[str]:
    return {name for name in files if name.split("/")[0] in PACKAGES}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(sdist, wheel), built from a copy of the tree."""
    source = tmp_path_factory.mktemp("source")
    for name in _tree_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    dist = tmp_path_factory.mktemp("dist")
    done = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(source)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (sdist,) = dist.glob("*.tar.gz")
    (wheel,) = dist.glob("*.whl")
    return sdist, wheel


def test_the_wheel_holds_every_package_file_of_the_tree(built: tuple[Path, Path]) -> None:
    expected = _package_files(_tree_files())
    assert any(name.startswith("workers/sources/") for name in expected)
    with zipfile.ZipFile(built[1]) as wheel:
        names = [name for name in wheel.namelist() if ".dist-info/" not in name]
    assert set(names) == expected, (
        f"missing from the wheel: {sorted(expected - set(names))}; "
        f"not from the packages: {sorted(set(names) - expected)}"
    )


def test_the_wheel_leaves_the_repositorys_own_folders_out(built: tuple[Path, Path]) -> None:
    with zipfile.ZipFile(built[1]) as wheel:
        tops = {name.split("/")[0] for name in wheel.namelist()}
        metadata = next(n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt"))
        entry_points = wheel.read(metadata).decode()
    assert {top for top in tops if not top.endswith(".dist-info")} == set(PACKAGES)
    assert "dali_capture_loader = loader.testing" in entry_points  # the pytest plugin


def test_the_sdist_holds_every_package_file_of_the_tree(built: tuple[Path, Path]) -> None:
    expected = _package_files(_tree_files())
    with tarfile.open(built[0]) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    missing = sorted(expected - names)
    assert missing == [], f"missing from the sdist: {missing}"


def test_one_version(built: tuple[Path, Path]) -> None:
    """The version is stated once (pyproject.toml): the wheel's name, the metadata and
    ``loader.__version__`` agree, and the changelog has a section for it."""
    import loader

    version = built[1].name.split("-")[1]
    assert loader.__version__ == version
    assert f"## {version} " in (ROOT / "CHANGELOG.md").read_text()
