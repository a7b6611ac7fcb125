"""Shared fixtures: every test is leak-checked; image datasets are generated once per process.
Loaders made without ``start_method`` fork their workers from one worker server per test process,
which the package's pytest plugin starts at the session's start (its default for a suite that
uses DALI); tests of spawn itself pass ``start_method="spawn"``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from loader.sample import write_sample_dataset
from workers.sources.storage import CACHE_DIR_ENV

pytest_plugins = ["pytester"]


@pytest.fixture(autouse=True)
def _no_leaks(leak_check: None) -> Iterator[None]:
    """No child process, memfd/socket/pipe descriptor or /dev/shm entry may outlive a test
    (``leak_check`` comes from the package's own pytest plugin, ``loader.testing``)."""
    yield


@pytest.fixture(autouse=True, scope="session")
def _cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Indexes of image folders go to a directory of this test session, not the user's cache
    (spawned workers inherit the environment)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_DIR_ENV, str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="session")
def image_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """48 small JPEGs in 3 classes (ImageFolder layout)."""
    root = tmp_path_factory.mktemp("images")
    return write_sample_dataset(root, count=48, classes=3, seed=1)
