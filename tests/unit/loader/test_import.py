"""``import loader`` in a script: the garbage collector waits while the package imports (no
full collection, over everything the script made before: after ``import torch``, one was due
there, ~0.08 s of the trainer's start), and is as the script left it afterwards."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import gc
    import sys

    if sys.argv[1] == "off":
        gc.disable()
    import torch  # (a script's own imports first: a full collection is due in the package's)
    collections = []
    gc.callbacks.append(lambda phase, info: phase == "start" and collections.append(info))
    import loader

    print(sum(info["generation"] == 2 for info in collections), gc.isenabled())
    """
)


@pytest.mark.parametrize(("before", "after"), [("on", "True"), ("off", "False")])
def test_no_collection_runs_while_the_package_imports(before: str, after: str) -> None:
    pytest.importorskip("torch")
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, before],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "DALI_LOADER_EARLY_SERVER": "0"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", after]
