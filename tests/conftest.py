"""Shared fixtures: every test is leak-checked; image datasets are generated once per process;
loaders made without ``start_method`` fork their workers from one worker server per test process
(the plugin's ``loader_worker_server``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from loader.sample import write_sample_dataset
from workers._folder_index import CACHE_DIR_ENV

pytest_plugins = ["pytester"]


@pytest.fixture(autouse=True)
def _no_leaks(leak_check: None) -> Iterator[None]:
    """No child process, memfd/socket/pipe descriptor or /dev/shm entry may outlive a test
    (``leak_check`` comes from the package's own pytest plugin, ``loader.testing``)."""
    yield


@pytest.fixture(autouse=True, scope="session")
def _worker_server(_cache_dir: None, loader_worker_server: str) -> Iterator[None]:
    """A Loader made without ``start_method`` forks its workers from this process's worker
    server (DALI imported once; ~0.2 s to a first batch instead of ~1.5 s for two spawned
    workers). Tests of spawn itself pass ``start_method="spawn"``."""
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
