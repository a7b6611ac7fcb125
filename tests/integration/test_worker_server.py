"""The worker server (loader/_server.py, workers/server.py): the default start method; how the
server starts (forked from a clean trainer, else a fresh interpreter), what it imports, what a
forked worker takes from the trainer, and that the server ends with its trainer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from loader import Loader, WorkerDiedError
from loader.config import _config
from loader.processes import server as _server

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]

#: A module the main script imports at its top: a line in imports.txt per process that runs it.
HEAVY = """
import os

with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "imports.txt"), "a") as f:
    f.write(f"{os.getpid()} heavy\\n")
"""

#: A main script whose every import outside the trainer is counted (a line in imports.txt per
#: process that imports it under another name than __main__), with {top} at its top.
SCRIPT = """
{top}
import json
import os
import sys

import heavy

if __name__ != "__main__":
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "imports.txt"), "a") as f:
        f.write(f"{{os.getpid()}} {{__name__}}\\n")

import numpy as np

from loader import Loader

from loader.processes import server as _server


class Ids:
    def __init__(self, shard):
        self.mine = list(range(shard.index, 32, shard.count))

    def __iter__(self):
        import nvidia.dali.experimental.dynamic as ndd

        for start in range(0, len(self.mine), 4):
            yield ndd.as_batch([np.array([i]) for i in self.mine[start:start + 4]])


def ids(shard):
    import nvidia.dali.experimental.dynamic as ndd

    return ndd.ExternalSource(Ids(shard), cycle="raise")


def step(batch):
    import nvidia.dali.experimental.dynamic as ndd

    return {{"id": ndd.cast(batch, dtype=ndd.int64)}}


def main():
    pids, parents = [], set()
    for _ in range(2):
        with Loader(ids, step, batch_size=4) as loader:  # the default start method
            got = sorted(int(v) for b in loader for v in np.asarray(b["id"]).ravel())
            assert got == list(range(32)), got
            pids += loader.worker_pids()
            parents |= {{psutil.Process(pid).ppid() for pid in loader.worker_pids()}}
    print(json.dumps({{"how": _server.started_how(), "server": _server.server_pid(),
                       "workers": pids, "parents": sorted(parents),
                       "method": loader.config.start_method}}))


if __name__ == "__main__":
    import psutil

    main()
"""

#: DALI imported and run in the trainer before its first loader.
DALI_RAN = """
import numpy as np
import nvidia.dali.experimental.dynamic as ndd

ndd.cast(ndd.as_batch([np.zeros(2)]), dtype=ndd.int32).evaluate()
"""


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DALI_LOADER_")}
    env.update(PYTHONPATH=str(ROOT), **extra)
    return env


def run_python(
    directory: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 200
) -> subprocess.CompletedProcess[str]:
    """``python *args`` in ``directory`` with :func:`clean_env` (or ``env``); it must succeed."""
    done = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=clean_env() if env is None else env,
        cwd=directory,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def run_script(
    tmp_path: Path, top: str, server: str | None
) -> tuple[dict[str, object], list[tuple[int, str]]]:
    (tmp_path / "heavy.py").write_text(HEAVY)
    script = tmp_path / "main_script.py"
    script.write_text(SCRIPT.format(top=top))
    env = clean_env(**({"DALI_LOADER_SERVER": server} if server else {}))
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=200,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    lines = (tmp_path / "imports.txt").read_text().split("\n")
    imports = [(int(pid), name) for pid, name in (line.split() for line in lines if line)]
    return found, imports


def test_a_script_importing_dali_at_its_top_gets_a_forked_server_by_default(
    tmp_path: Path,
) -> None:
    """The README's shape (DALI imported at the top, nothing run): with no setting, the server
    is forked from the trainer, imports the main script once as __mp_main__ and nothing it
    imported again (heavy.py runs in the trainer only); the workers of both loaders are the
    server's children and import nothing."""
    found, imports = run_script(tmp_path, "import nvidia.dali.experimental.dynamic", None)
    assert found["how"] == "fork"
    assert found["method"] == "forkserver"
    assert found["parents"] == [found["server"]]
    assert len(found["workers"]) == 4  # type: ignore[arg-type]
    trainer = [pid for pid, name in imports if name == "heavy" and pid != found["server"]]
    assert [name for _pid, name in imports] == ["heavy", "__mp_main__"], imports
    assert imports[1][0] == found["server"] and len(trainer) == 1


def test_a_fresh_server_imports_the_main_module_once_as_mp_main(tmp_path: Path) -> None:
    """exec: the server imports the script (and what it imports) once, as __mp_main__ (its
    __main__ block does not run there); the four workers of two loaders import it no more."""
    found, imports = run_script(tmp_path, "import numpy", "exec")
    assert found["how"] == "exec"
    assert [name for _pid, name in imports] == ["heavy", "heavy", "__mp_main__"], imports
    assert {pid for pid, _name in imports[1:]} == {found["server"]}


def test_a_trainer_that_ran_dali_gets_a_fresh_server(tmp_path: Path) -> None:
    """A fork of a process whose DALI threads run would hang: that trainer's server is a new
    interpreter, found without any setting."""
    found, _imports = run_script(tmp_path, DALI_RAN, None)
    assert found["how"] == "exec"
    assert found["parents"] == [found["server"]]


def test_a_forced_fork_is_refused_when_unsafe(tmp_path: Path) -> None:
    (tmp_path / "heavy.py").write_text(HEAVY)
    script = tmp_path / "main_script.py"
    script.write_text(SCRIPT.format(top=DALI_RAN))
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=200,
        env=clean_env(DALI_LOADER_SERVER="fork"),
    )
    assert done.returncode != 0
    assert "DALI has run operators in this process" in done.stderr
    assert "Unset DALI_LOADER_SERVER" in done.stderr


def test_the_default_start_method(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_config.START_METHOD_ENV, raising=False)
    previous = _config.set_default_start_method(None)
    try:
        assert _config.check_start_method(None) == "forkserver"
        monkeypatch.setenv(_config.START_METHOD_ENV, "spawn")
        assert _config.check_start_method(None) == "spawn"
        assert _config.check_start_method("forkserver") == "forkserver"
        monkeypatch.setenv(_config.START_METHOD_ENV, "fork")
        with pytest.raises(ValueError, match="DALI_LOADER_START_METHOD='fork'"):
            _config.check_start_method(None)
        _config.set_default_start_method("spawn")
        assert _config.check_start_method(None) == "spawn"  # the process's default first
    finally:
        _config.set_default_start_method(previous)


class MarkBatches:
    """One batch of 4 samples, each what ``read_mark`` finds in the worker."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __iter__(self):  # type: ignore[no-untyped-def]
        import numpy as np
        import nvidia.dali.experimental.dynamic as ndd

        yield ndd.as_batch([np.array([read_mark(self.kind)], dtype=np.int64)] * 4)


def read_mark(kind: str) -> int:
    if kind == "env":
        return int(os.environ.get("LOADER_TEST_MARK", "0"))
    if kind == "cwd":
        return int(Path("mark.txt").read_text())  # relative to the working directory
    import loader_test_mark  # importable only through a sys.path entry added by the test

    return int(loader_test_mark.MARK)


def mark_source(shard: object, kind: str) -> object:
    import nvidia.dali.experimental.dynamic as ndd

    return ndd.ExternalSource(MarkBatches(kind), cycle="raise")


def mark_step(batch: object) -> dict[str, object]:
    import nvidia.dali.experimental.dynamic as ndd

    return {"mark": ndd.cast(batch, dtype=ndd.int64)}


def marks(kind: str) -> set[int]:
    import functools

    source = functools.partial(mark_source, kind=kind)
    with Loader(source, mark_step, batch_size=4, num_workers=1) as loader:
        assert _server.server_pid() in {psutil.Process(p).ppid() for p in loader.worker_pids()}
        return {int(v) for b in loader for v in b["mark"].ravel()}


def test_forked_workers_get_the_trainers_environment_of_now(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As a spawned worker does: a variable set after the server started reaches the workers."""
    monkeypatch.setenv("LOADER_TEST_MARK", "3")
    assert marks("env") == {3}
    monkeypatch.setenv("LOADER_TEST_MARK", "5")
    assert marks("env") == {5}


def test_forked_workers_get_the_trainers_directory_and_path_of_now(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "mark.txt").write_text("7")
    (tmp_path / "loader_test_mark.py").write_text("MARK = 11\n")
    monkeypatch.chdir(tmp_path)
    assert marks("cwd") == {7}
    monkeypatch.syspath_prepend(str(tmp_path))
    assert marks("path") == {11}


def test_a_worker_killed_by_a_signal_is_reported_through_the_server() -> None:
    """The server reaps its children and writes each exit code to the trainer: a worker killed
    by SIGKILL is a WorkerDiedError that names the signal, at once."""
    from tests import pipelines as P

    with Loader(P.sample_source, P.cast_step, batch_size=4, num_workers=1) as loader:
        batches = iter(loader)
        next(batches)
        os.kill(loader.worker_pids()[0], signal.SIGKILL)
        with pytest.raises(WorkerDiedError, match="SIGKILL"):
            for _ in batches:
                pass


def test_a_worker_replaced_after_the_server_was_shut_down_is_forked_from_a_new_one() -> None:
    """``shutdown_worker_server()`` while a loader is open: a worker of that loader killed
    later is replaced (``max_restarts``) from the process's new server; the old one, stopped,
    failed the replacement ("the loader's worker server is gone")."""
    from loader import shutdown_worker_server
    from tests import pipelines as P

    with Loader(
        P.sample_source, P.cast_step, batch_size=4, num_workers=1, copy=True, max_restarts=1
    ) as loader:
        batches = iter(loader)
        seen = [int(i) for i in next(batches)["id"].ravel()]
        assert shutdown_worker_server() is not None
        os.kill(loader.worker_pids()[0], signal.SIGKILL)
        for batch in batches:
            seen += [int(i) for i in batch["id"].ravel()[: 4 - batch.info.padded]]
    assert sorted(seen) == list(range(30))


EARLY_PACKAGE = """
from loader.processes import server as _server

HOW = _server.start_early()  # what the loader package's import does at its end

import nvidia.dali.experimental.dynamic as ndd


def source(shard):  # defined after the server was forked
    import numpy as np

    return ndd.ExternalSource(iter([ndd.as_batch([np.array([shard.index])] * 4)]), cycle="raise")


def step(batch):
    return {"x": ndd.cast(batch, dtype=ndd.int64)}
"""

EARLY_SCRIPT = """
import json
import mylib
from loader import Loader
from loader.processes import server as _server

if __name__ == "__main__":
    server = _server.server_pid()
    with Loader(mylib.source, mylib.step, batch_size=4) as loader:
        xs = sorted(int(v) for b in loader for v in b["x"].ravel())
    print(json.dumps({"early": mylib.HOW, "same": server == _server.server_pid(), "xs": xs}))
"""


def test_an_early_server_imports_the_modules_it_was_forked_in_again(tmp_path: Path) -> None:
    """A server started in the middle of an import (mylib's top, before mylib defines its
    functions) drops the modules still executing and imports them when a loader needs them:
    the loader's workers find mylib.source, and the early server is the one used."""
    (tmp_path / "mylib.py").write_text(EARLY_PACKAGE)
    (tmp_path / "main.py").write_text(EARLY_SCRIPT)
    done = run_python(tmp_path, "main.py")
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {"early": "fork", "same": True, "xs": [0, 0, 0, 0, 1, 1, 1, 1]}


def test_the_server_ends_with_its_trainer(tmp_path: Path) -> None:
    """Nothing outlives the trainer: the server sees the end of its socket and exits, even
    when the trainer is killed."""
    script = tmp_path / "main.py"
    script.write_text(
        "import sys, time\n"
        "from loader.processes import server as _server\n"
        "print(_server.ensure_running(), _server.server_pid(), flush=True)\n"
        "time.sleep(60)\n"
    )
    trainer = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=clean_env()
    )
    try:
        assert trainer.stdout is not None
        how, pid = trainer.stdout.readline().split()
        server = psutil.Process(int(pid))
        assert how == "fork" and server.ppid() == trainer.pid
    finally:
        trainer.kill()
        trainer.wait(10)
    deadline = time.monotonic() + 10
    while server.is_running() and server.status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the worker server outlived its trainer"
        time.sleep(0.05)


STOP_SCRIPT = """
import functools
import json
import psutil
import loader
from loader import Loader
from tests import pipelines as P

SOURCE = functools.partial(P.sample_source, total=16)


def titles(pid):
    server = psutil.Process(pid)
    def title(process):  # the words of its command line (setproctitle may pad it with spaces)
        return " ".join(" ".join(process.cmdline()).split())

    return [title(server)] + sorted(title(c) for c in server.children())

if __name__ == "__main__":
    found = {}
    with Loader(SOURCE, P.cast_step, batch_size=4, num_workers=2) as first:
        batches = iter(first)
        xs = [int(v) for v in next(batches)["id"].ravel()]
        pid = loader.worker_server_pid()
        found["titles"] = titles(pid)
        found["stopped"] = loader.shutdown_worker_server() == pid
        found["again"] = loader.shutdown_worker_server()
        found["none_after_stop"] = loader.worker_server_pid()
        xs += [int(v) for batch in batches for v in batch["id"].ravel()]
        found["first_epoch"] = sorted(xs)
        found["server_waited_for_its_workers"] = psutil.pid_exists(pid)
    with Loader(SOURCE, P.cast_step, batch_size=4, num_workers=2) as second:
        found["second_epoch"] = sorted(int(v) for b in second for v in b["id"].ravel())
        found["new_server"] = loader.worker_server_pid() not in (None, pid)
    found["stopped_second"] = loader.shutdown_worker_server() is not None
    found["children_left"] = [
        c.pid for c in psutil.Process().children(recursive=True)
        if c.status() != psutil.STATUS_ZOMBIE
    ]
    print(json.dumps(found))
"""


def test_the_worker_server_is_named_stopped_and_started_again(tmp_path: Path) -> None:
    """``worker_server_pid()`` names the server; ``ps`` tells it from the workers by title;
    ``shutdown_worker_server()`` stops it (a loader that is open keeps its workers to the end of
    its epoch), is safe to call twice, and the next loader starts a new server."""
    script = tmp_path / "main.py"
    script.write_text(STOP_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=200,
        env=clean_env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    trainer = found["titles"][0].split(" ", 1)[1]
    assert found["titles"][0].startswith("dali-loader-server (trainer ")
    assert found["titles"][1:] == [
        f"dali-loader-worker-0 {trainer}",
        f"dali-loader-worker-1 {trainer}",
    ]
    everything = list(range(16))
    assert found["first_epoch"] == everything, "the open loader lost its workers at the stop"
    assert found["second_epoch"] == everything
    assert found["stopped"] and found["again"] is None and found["none_after_stop"] is None
    assert found["new_server"] and found["stopped_second"]
    assert found["children_left"] == []


def test_the_server_and_its_workers_end_with_a_killed_trainer(tmp_path: Path) -> None:
    """A trainer killed by SIGKILL while its loader's workers run: the workers follow it, and the
    server exits after them (it waits for the workers it forked)."""
    script = tmp_path / "main.py"
    script.write_text(
        "import sys, time\n"
        "import loader\n"
        "from loader import Loader\n"
        "from tests import pipelines as P\n"
        "if __name__ == '__main__':\n"
        "    with Loader(P.sample_source, P.cast_step, batch_size=4, num_workers=2) as l:\n"
        "        next(iter(l))\n"
        "        print(loader.worker_server_pid(), *l.worker_pids(), flush=True)\n"
        "        time.sleep(60)\n"
    )
    trainer = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )
    try:
        assert trainer.stdout is not None
        processes = [psutil.Process(int(pid)) for pid in trainer.stdout.readline().split()]
        assert len(processes) == 3
    finally:
        trainer.kill()
        trainer.wait(10)
        if trainer.stdout is not None:
            trainer.stdout.close()
    deadline = time.monotonic() + 20
    for process in processes:
        while process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, f"{process.cmdline()} outlived its trainer"
            time.sleep(0.05)


IMPORT_ONLY = """
import json
import multiprocessing
import sys

import loader
from loader.processes import server as _server


def child(queue):  # a spawned child that imports the loader (a pool's process, a worker)
    import loader  # noqa: F401
    from loader.processes import server as _server

    queue.put(_server.started_how())


if __name__ == "__main__":
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=child, args=(queue,))
    process.start()
    spawned = queue.get(timeout=120)
    process.join()
    print(json.dumps({"trainer": _server.started_how(), "spawned": spawned}))
"""


@pytest.mark.parametrize("early", ["", "0"])
def test_importing_the_loader_starts_the_worker_server_in_a_trainer_only(
    tmp_path: Path, early: str
) -> None:
    """``import loader`` in a script forks the worker server at once (its DALI import and the
    capture's source analysis then overlap the script's own start), unless
    ``DALI_LOADER_EARLY_SERVER=0``; a spawned child that imports the loader starts none."""
    (tmp_path / "main.py").write_text(IMPORT_ONLY)
    env = clean_env()
    env.pop(_server.EARLY_ENV, None)
    if early:
        env[_server.EARLY_ENV] = early
    done = run_python(tmp_path, "main.py", env=env)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {"trainer": None if early == "0" else "fork", "spawned": None}


#: A script whose top level only defines (its imports, functions, a constant made by a call):
#: the server imports it as soon as it is warm, before any loader is made. ``MARK`` records each
#: process that runs the top level; the trainer waits, without making a loader, for the server.
EAGER_SCRIPT = """
import json, os, sys, time
import loader
from loader.processes import server as _server

def mark():
    with open(os.environ["MARKS"], "a") as file:
        file.write(f"{os.getpid()}\\n")
    return True

MARK = mark()

if __name__ == "__main__":
    pid = _server.server_pid()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        marks = [int(line) for line in open(os.environ["MARKS"]).read().split()]
        if pid in marks:
            break
        time.sleep(0.05)
    print(json.dumps({"server": pid, "trainer": os.getpid(), "marks": marks}))
"""

#: The same top level with work outside the guard (a print): not imported before a loader.
UNGUARDED_SCRIPT = EAGER_SCRIPT.replace("MARK = mark()", "MARK = mark()\nprint('working')")


@pytest.mark.parametrize("form", ["defines-only", "work-at-top"])
def test_a_main_module_that_only_defines_is_imported_while_the_trainer_sets_up(
    tmp_path: Path, form: str
) -> None:
    """The server imports a main module whose top level only defines as soon as it is warm
    (its imports then overlap the trainer's own set-up instead of following ``Loader(...)``:
    a script importing heavy modules after ``import loader`` reached its first batch 0.4-0.5 s
    after ``Loader(...)`` instead of 1.4-1.5 s); one that does work at its top level (it may
    never make a loader) is left alone until a loader needs it."""
    marks = tmp_path / "marks"
    marks.write_text("")
    script = tmp_path / "main.py"
    script.write_text(EAGER_SCRIPT if form == "defines-only" else UNGUARDED_SCRIPT)
    env = clean_env(MARKS=str(marks))
    if form == "defines-only":
        found = json.loads(run_python(tmp_path, "main.py", env=env).stdout.splitlines()[-1])
        assert found["server"] in found["marks"] and found["trainer"] in found["marks"]
        return
    trainer = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env, cwd=tmp_path
    )
    try:
        time.sleep(8)  # (the server is warm well before this: DALI, then nothing more)
        assert [int(line) for line in marks.read_text().split()] == [trainer.pid]
    finally:
        trainer.kill()
        trainer.wait(10)


RELEASE_SCRIPT = """
import json, os
read_end, write_end = os.pipe()  # open as the server is forked (a test session's pipes)
pipe = os.readlink(f"/proc/self/fd/{read_end}")
import loader  # (the server is forked at the end of the import)
from loader.processes import server as _server

released = _server.wait_released(60)
pid = _server.server_pid()
held = [os.readlink(f"/proc/{pid}/fd/{name}") for name in os.listdir(f"/proc/{pid}/fd")]
print(json.dumps({"how": _server.started_how(), "released": released, "pipe": pipe,
                  "held": held, "again": _server.wait_released(0)}))
"""


def test_a_forked_server_has_released_the_trainers_pipes_once_wait_released_returns(
    tmp_path: Path,
) -> None:
    """A server forked from the trainer holds copies of the trainer's descriptors until it has
    released them; ``wait_released`` returns once it has (a leak check's snapshot waits for it:
    a test's first snapshot taken before the release counted the trainer's pipes as the
    server's, and its last one then found them as the test's leak)."""
    script = tmp_path / "released.py"
    script.write_text(RELEASE_SCRIPT)
    found = json.loads(run_python(tmp_path, str(script)).stdout.strip().splitlines()[-1])
    assert found["how"] == "fork"
    assert found["released"] is True and found["again"] is True
    assert found["pipe"].startswith("pipe:")
    assert found["pipe"] not in found["held"], found


MODEL_AT_THE_TOP = """
import numpy as np
import torch

from loader import Loader, sharded_source
from tests import pipelines as P

# a model run at the top of the script (its output's size read before training): the worker
# server runs it too, as it imports the script for its workers
weights = torch.randn(512, 512)
for _ in range(5):
    weights = torch.tanh(weights @ weights)


def source(shard):
    # on the worker's main thread, as a source that builds its own model would
    scratch = torch.randn(512, 512)
    for _ in range(3):
        scratch = torch.tanh(scratch @ scratch)
    return sharded_source(shard, 16, lambda i: np.array([i], dtype=np.int64), 4)


if __name__ == "__main__":
    with Loader(source, P.cast_step, batch_size=4, num_workers=2, startup_timeout=60) as l:
        print(sorted(int(v) for b in l for v in b["id"].ravel()))
"""


def test_torch_math_at_a_scripts_top_does_not_hang_its_forked_workers(tmp_path: Path) -> None:
    """The server runs the script's top level with torch's math on one thread: on more it
    started an OpenMP pool there, and a worker forked from it whose main thread ran a matrix
    product waited for that pool's threads for ever (until the start timeout)."""
    script = tmp_path / "model_at_the_top.py"
    script.write_text(MODEL_AT_THE_TOP)
    done = run_python(tmp_path, str(script), timeout=150)  # (stuck: a StartupError at 60 s)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == list(range(16))
