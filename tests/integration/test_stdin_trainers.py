"""Trainers fed to Python on standard input (``python - < train.py``, ``cat train.py | python``, a
heredoc) or given with ``python -c``: their main module has no file, so the workers import none
(loader/config/_validate.py ``main_file``, the worker server's Setup, the pool's spawn). Functions
imported from a module run as from a file; functions defined in the script itself are refused in
the trainer, before any worker starts, with one error that says what to do. Each trainer runs in
its own session: once it has exited, nothing it started may be left."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.test_worker_server import clean_env

pytestmark = pytest.mark.timeout(240)

#: The module next to the trainer (found through its directory, as a user's would be).
PIPES = """
import functools

from tests.pipelines import cast_step as step, id_source

ids = functools.partial(id_source, total=32)
"""

#: A trainer whose source and step come from that module.
IMPORTING = """
import json

import numpy as np

from loader import Loader
from mypipes import ids, step

if __name__ == "__main__":
    with Loader(ids, step, batch_size=4, num_workers=2, start_method="{method}") as loader:
        batches = [np.asarray(batch["id"]).ravel().tolist() for batch in loader]
    print(json.dumps(batches))
"""

#: A trainer that defines its step itself.
DEFINING = """
import nvidia.dali.experimental.dynamic as ndd

from loader import Loader
from mypipes import ids


def step(batch):
    return {"id": ndd.cast(batch, dtype=ndd.int64)}


if __name__ == "__main__":
    with Loader(ids, step, batch_size=4, num_workers=2) as loader:
        print(sum(1 for _ in loader))
"""

#: A trainer whose source is a partial of an imported function, over a class of its own.
PARTIAL_OVER_OWN_CLASS = """
import functools

from loader import Loader, sharded_source
from mypipes import step


class Load:
    def __call__(self, index):
        return index


if __name__ == "__main__":
    with Loader(functools.partial(sharded_source, total=32, load=Load()), step, batch_size=4):
        pass
"""

#: How long a trainer's processes may outlive it (the server exits after its workers).
LEFT_WAIT = 15.0


def run_trainer(
    command: list[str], folder: Path, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` in ``folder`` (with :data:`PIPES` as ``mypipes.py``) in a session of its
    own, ``stdin`` on its standard input; once it has exited, every process it started must be
    gone within :data:`LEFT_WAIT` seconds (SIGKILLed, and the test fails, otherwise)."""
    (folder / "mypipes.py").write_text(PIPES)
    process = subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=folder,
        env=clean_env(),
        start_new_session=True,
    )
    try:
        out, err = process.communicate(stdin, timeout=200)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    deadline = time.monotonic() + LEFT_WAIT
    while True:
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            break
        if time.monotonic() > deadline:
            os.killpg(process.pid, signal.SIGKILL)
            pytest.fail(f"processes of the trainer outlived it by {LEFT_WAIT:g} s\n{err[-3000:]}")
        time.sleep(0.1)
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def heredoc(script: str) -> list[str]:
    """``bash -c`` running this interpreter on ``script`` as a heredoc."""
    assert "\nEOF\n" not in script
    return ["bash", "-c", f"{shlex.quote(sys.executable)} - <<'EOF'\n{script}\nEOF\n"]


def check_batches(done: subprocess.CompletedProcess[str]) -> None:
    """The trainer ran cleanly and got every id once, in batches of 4."""
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    batches = json.loads(done.stdout.strip().splitlines()[-1])
    assert [len(batch) for batch in batches] == [4] * 8
    assert sorted(i for batch in batches for i in batch) == list(range(32))


@pytest.mark.parametrize(
    ("method", "args"),
    [("forkserver", ["-"]), ("spawn", ["-"])],
    ids=["forkserver-dash", "spawn-dash"],
)
def test_imported_functions_run_from_stdin(tmp_path: Path, method: str, args: list[str]) -> None:
    """``python - < train.py`` (and so ``cat train.py | python -``): neither the worker server nor a
    spawned worker runs ``<stdin>`` as a file (each failed on it, and the trainer blamed the
    ``__main__`` guard)."""
    script = IMPORTING.format(method=method)
    check_batches(run_trainer([sys.executable, *args], tmp_path, stdin=script))


def test_imported_functions_run_from_a_heredoc(tmp_path: Path) -> None:
    check_batches(run_trainer(heredoc(IMPORTING.format(method="forkserver")), tmp_path))


def check_refused(done: subprocess.CompletedProcess[str], where: str, name: str = "step") -> None:
    """One error, the trainer's, raised before any worker started: it names ``name``, where it
    is defined, and what to do."""
    err = done.stderr
    assert done.returncode == 1, err[-3000:]
    assert err.count("Traceback (most recent call last)") == 1, err[-3000:]
    assert "_check_functions" in err  # (raised by the checks, before any worker started)
    last = err.strip().splitlines()[-1]
    assert last.startswith("TypeError: "), last
    assert any(f"{name}{tail} is defined in {where}" in last for tail in (")", ", which")), last
    assert "Save the script to a file and run it as `python train.py`" in last, last
    assert f"or move {name} to a module that the script imports" in last, last
    for noise in ("WorkerDiedError", "FileNotFoundError", "__main__", "dali-loader-worker"):
        assert noise not in err, err[-3000:]


STDIN = "a script read from standard input (`python -`, a pipe or a heredoc)"


def test_functions_defined_in_stdin_are_refused_before_workers_start(tmp_path: Path) -> None:
    done = run_trainer([sys.executable, "-"], tmp_path, stdin=DEFINING)
    check_refused(done, STDIN)


def test_a_partial_over_a_class_of_the_stdin_script_is_refused(tmp_path: Path) -> None:
    """The partial's function is importable, but an argument's class lives in ``__main__``: a
    worker could not unpickle it."""
    done = run_trainer([sys.executable, "-"], tmp_path, stdin=PARTIAL_OVER_OWN_CLASS)
    check_refused(done, STDIN, name="Load")
    assert "source: the arguments of this partial refer to Load" in done.stderr


def test_functions_defined_in_python_c_are_refused_as_such(tmp_path: Path) -> None:
    done = run_trainer([sys.executable, "-c", DEFINING], tmp_path)
    check_refused(done, "code given with `python -c`")
