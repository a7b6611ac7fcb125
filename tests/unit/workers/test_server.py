"""The worker server's collection-free imports (:func:`workers.server._frozen_after`), and which
main modules it imports before a loader is made (:func:`workers.server.only_defines`)."""

from __future__ import annotations

import gc
import os
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from workers import server


@pytest.fixture
def unfrozen() -> Iterator[None]:
    yield
    gc.unfreeze()
    gc.enable()


@pytest.mark.usefixtures("unfrozen")
def test_no_collection_while_it_runs_then_everything_frozen_and_collection_back_on() -> None:
    gc.enable()
    before = gc.get_freeze_count()
    with server._frozen_after():
        assert not gc.isenabled()
        made = [[i] for i in range(1000)]
    assert gc.isenabled()
    assert gc.get_freeze_count() >= before + len(made)


@pytest.mark.usefixtures("unfrozen")
def test_collection_left_off_when_it_was_off_and_on_after_a_failure() -> None:
    gc.disable()
    with server._frozen_after():
        pass
    assert not gc.isenabled()
    gc.enable()
    with pytest.raises(ZeroDivisionError), server._frozen_after():
        1 / 0  # noqa: B018
    assert gc.isenabled()


def _defines(tmp_path: Path, text: str) -> bool:
    path = tmp_path / "main.py"
    path.write_text(textwrap.dedent(text))
    return server.only_defines(str(path))


def test_a_main_module_that_only_defines_may_be_imported_early(tmp_path: Path) -> None:
    guarded = """
        '''A training script.'''
        import functools
        try:
            import torch
        except ImportError:
            torch = None
        if torch is not None:
            DEVICE = "cpu"
        SOURCE = functools.partial(print, 1)

        def step(x):
            return x

        class Model:
            pass

        if __name__ == "__main__":
            run()
    """
    assert _defines(tmp_path, guarded)
    assert _defines(tmp_path, guarded.replace('__name__ == "__main__"', '"__main__" == __name__'))


def test_a_main_module_with_work_at_its_top_or_no_guard_is_left_for_a_loader(
    tmp_path: Path,
) -> None:
    assert not _defines(tmp_path, "import time\ntime.sleep(60)\n")  # (no guard: work at the top)
    assert not _defines(tmp_path, "def f():\n    pass\n")  # (no guard)
    body = "import time\n{}\nif __name__ == '__main__':\n    pass\n"
    for work in ("print('x')", "for i in range(3):\n    pass", "with open('f') as f:\n    pass"):
        assert not _defines(tmp_path, body.format(work)), work
    assert not _defines(tmp_path, "if True:\n    print(1)\nif __name__ == '__main__':\n    pass\n")
    assert not _defines(tmp_path, "if __name__ == '__main__':\n    pass\nelse:\n    print(1)\n")
    assert not server.only_defines(None) and not server.only_defines(str(tmp_path / "missing.py"))
    assert not _defines(tmp_path, "def (:\n")  # (not Python)


def test_workers_left_by_a_gone_trainer_are_killed_and_reaped(tmp_path: Path) -> None:
    """What the server does once its trainer is gone and :data:`workers.server.ORPHANED_WAIT`
    has passed: a worker still there (it ignores the trainer's signals, and one stuck before it
    watches its liveness pipe never exits by itself) is killed and reaped, its status closed."""
    import socket
    import subprocess
    import sys

    ignoring = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    stuck = subprocess.Popen([sys.executable, "-c", ignoring])
    ours, theirs = socket.socketpair()
    status, status_peer = socket.socketpair()
    with ours, theirs, status_peer:
        serving = server.Server(ours, None)  # type: ignore[arg-type]  (no setup: nothing forked)
        try:
            serving._statuses[stuck.pid] = status
            serving._kill_left()
        finally:
            os.close(serving._wake_read)
            os.close(serving._wake_write)
        assert not serving._statuses
        assert status.fileno() == -1  # closed
    import psutil

    assert not psutil.pid_exists(stuck.pid)


def test_a_worker_whose_trainer_closed_its_start_pipe_unwritten_exits_quietly() -> None:
    """The trainer stopped (Ctrl-C, a cluster's SIGTERM) between asking for a worker and sending
    it its start: the worker exits with 0 and prints nothing (it printed an ``EOFError``
    traceback, which read like a crash of its own)."""
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(write)  # (closed unwritten)
    others = [os.open(os.devnull, os.O_RDONLY) for _ in range(3)]
    code = (
        "import sys; from workers import server; "
        f"server._start_forked_worker([{read}, {others[0]}, {others[1]}, {others[2]}])"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", code],
            pass_fds=(read, *others),
            capture_output=True,
            text=True,
            timeout=60,
            cwd=Path(__file__).resolve().parents[3],
        )
    finally:
        for fd in (read, *others):
            os.close(fd)
    assert (done.returncode, done.stderr) == (0, "")
