"""An ImageFolder is listed once per job: later source builds (a break, a resume, a replacement)
read its index instead."""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loader import Loader
from tests import pipelines as P
from workers.sources.storage import CACHE_DIR_ENV

pytestmark = pytest.mark.timeout(240)


def ids_of(batches: list[Any]) -> list[int]:
    return sorted(
        int(label)
        for batch in batches
        for label in np.asarray(batch["id"]).ravel()[: len(batch["id"]) - batch.info.padded]
    )


def test_starts_breaks_resumes_and_replacements_list_the_folder_once(
    image_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    root = tmp_path / "images"
    shutil.copytree(image_root, root)
    long_ago = time.time() - 60  # (an index of a folder changed in the last moments is not kept)
    for folder in [root, *root.iterdir()]:
        os.utime(folder, (long_ago, long_ago))
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    caplog.set_level(logging.INFO, logger="loader")  # (workers log at the trainer's level)
    source = functools.partial(P.files_source, root=str(root))
    with Loader(
        source, P.bytes_and_label_step, batch_size=4, num_workers=2, copy=True, max_restarts=1
    ) as loader:
        batches = iter(loader)
        first = [next(batches)]
        state = loader.state_dict()
        os.kill(loader.worker_pids()[0], signal.SIGKILL)  # a replacement builds its source
        epoch = first + list(batches)
        assert loader.stats().restarts == 1
        next(iter(loader))  # then left: every worker rebuilds its source
        next(iter(loader))
        loader.load_state_dict(state)  # every worker rebuilds at the position
        resumed = first + list(loader)
    assert ids_of(epoch) == ids_of(resumed) == sorted([0] * 16 + [1] * 16 + [2] * 16)
    listed = [r.getMessage() for r in caplog.records if "listed " in r.getMessage()]
    assert len(listed) == 1, listed
    assert "48 files" in listed[0] and "indexed in" in listed[0]
