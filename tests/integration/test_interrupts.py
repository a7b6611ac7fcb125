"""Ctrl-C in the training loop: ``try: for batch in loader: ... except KeyboardInterrupt:
save(loader.state_dict())``. A terminal's Ctrl-C is SIGINT to the whole foreground process group,
so the trainer, its worker server and its workers all get it: the real signal to a real group,
landing while ``next()`` waits for data and while user code runs between batches; then, in this
process, the real signal at chosen moments inside the loader (a profile hook picks the moment,
the default handler raises ``KeyboardInterrupt``): blocked in the wait (the loader goes on), while
a worker's record is handled, while a batch is handed out, while a resumed epoch starts (the
workers are stopped, and the loader says why). In every case ``state_dict()`` works and the run
resumed from it gets every sample exactly once; and a storm of SIGINT while the worker server
and spawned workers start kills none of them."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from loader import Loader, LoaderClosedError
from loader.engine._coordinator import Coordinator
from loader.engine._routing import Router
from loader.engine._views import build_batch
from loader.engine._waiting import Waiter
from tests import pipelines as P
from tests.integration.test_preemption import _group_gone
from tests.integration.test_worker_server import clean_env

pytestmark = pytest.mark.timeout(240)

TOTAL = 96  # 24 batches of 4 over 2 workers

TRAINER = """
import functools, json, os, pickle, signal, sys, time, traceback
from loader import Loader
from tests import pipelines as P

SOURCE = functools.partial(P.slow_source, total={total}, seconds={seconds})


def main(state_file, seen_file, pause):
    # SIGINT as a terminal gives it (a suite started in the background may inherit it ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    resumed = os.path.exists(state_file)
    seen, where = [], None
    with Loader(SOURCE, P.cast_step, batch_size=4, num_workers=2) as loader:
        if resumed:
            with open(state_file, "rb") as f:
                loader.load_state_dict(pickle.load(f))
        try:
            for batch in loader:
                rows = P.ids_of(batch)
                seen += rows[: len(rows) - batch.info.padded]
                if len(seen) == 16 and not resumed:
                    print("ready", flush=True)
                time.sleep(pause)  # the training step
        except KeyboardInterrupt as error:
            where = traceback.extract_tb(error.__traceback__)[-1].filename
            with open(state_file, "wb") as f:
                pickle.dump(loader.state_dict(), f)
    with open(seen_file, "w") as f:
        json.dump({{"seen": seen, "where": where}}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
"""


def _start(script: Path, tmp_path: Path, name: str, pause: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            str(script),
            str(tmp_path / "state.pkl"),
            str(tmp_path / name),
            str(pause),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
        start_new_session=True,  # its own process group, as a job's in a terminal
    )


def _members(group: int) -> list[int]:
    members = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(ProcessLookupError):
                if os.getpgid(int(name)) == group:
                    members.append(int(name))
    return members


def _ctrl_c_when_ready(trainer: subprocess.Popen[str]) -> None:
    """SIGINT to the trainer's whole process group, as a terminal's Ctrl-C sends it."""
    assert trainer.stdout is not None
    line = trainer.stdout.readline()
    assert line.strip() == "ready", line + (trainer.stderr.read() if trainer.stderr else "")
    assert len(_members(trainer.pid)) >= 4  # the trainer, its server and two workers
    time.sleep(0.05)  # the trainer is inside next() (0.2 s a batch) or its training step (0.3 s)
    os.killpg(trainer.pid, signal.SIGINT)


@pytest.mark.parametrize(
    ("seconds", "pause", "lands_in"),
    [(0.1, 0.0, "next"), (0.0, 0.3, "user code")],
    ids=["waiting-in-next", "in-user-code"],
)
def test_ctrl_c_to_the_process_group_saves_a_state_that_resumes_exactly_once(
    tmp_path: Path, seconds: float, pause: float, lands_in: str
) -> None:
    """A slow pipeline keeps the trainer waiting inside ``next()``; a slow training step keeps
    it in user code between batches. Either way the trainer catches ``KeyboardInterrupt``,
    saves ``state_dict()`` and exits 0, its workers and server print nothing and leave, and the
    resumed run gets the rest: every sample once over both runs."""
    script = tmp_path / "train.py"
    script.write_text(TRAINER.format(total=TOTAL, seconds=seconds))
    trainer = _start(script, tmp_path, "first.json", pause)
    try:
        _ctrl_c_when_ready(trainer)
        _out, err = trainer.communicate(timeout=120)
    finally:
        trainer.kill()
    assert trainer.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "died" not in err, err[-3000:]
    assert _group_gone(trainer.pid, 20), "a process of the job outlived its trainer"
    first = json.loads((tmp_path / "first.json").read_text())
    inside_loader = os.sep + "loader" + os.sep in first["where"]
    assert inside_loader == (lands_in == "next"), first["where"]
    assert 16 <= len(first["seen"]) < TOTAL

    again = _start(script, tmp_path, "second.json", 0.0)
    _out, err = again.communicate(timeout=120)
    assert again.returncode == 0, err[-3000:]
    second = json.loads((tmp_path / "second.json").read_text())
    assert second["where"] is None
    assert sorted(first["seen"] + second["seen"]) == list(range(TOTAL)), "not exactly once"
    assert _group_gone(again.pid, 20)


# ------------------------------------------------------------------ the moment, in this process
Moment = Callable[[FrameType, str, Any], bool]
_POLL = type(select.poll())


def entering(function: Callable[..., Any]) -> Moment:
    """The moment the loader's code calls ``function``."""
    code = function.__code__
    return lambda frame, event, arg: event == "call" and frame.f_code is code


def blocked_in_wait(frame: FrameType, event: str, arg: Any) -> bool:
    """The moment the trainer's wait on its workers enters its poll."""
    return (
        event == "c_call"
        and frame.f_code is Waiter.wait.__code__
        and isinstance(getattr(arg, "__self__", None), _POLL)
    )


@contextlib.contextmanager
def ctrl_c_at(moment: Moment) -> Iterator[list[str]]:
    """A real SIGINT to this process, under Python's default handler, at the first ``moment``
    of the block (found by a profile hook on this thread): Python raises ``KeyboardInterrupt``
    there, as at a Ctrl-C that lands then. Yields a list that holds the moment once it came."""
    fired: list[str] = []

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        if not fired and moment(frame, event, arg):
            sys.setprofile(None)
            fired.append(frame.f_code.co_name)
            signal.raise_signal(signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.setprofile(hook)
    try:
        yield fired
    finally:
        sys.setprofile(None)
        signal.signal(signal.SIGINT, previous)


def make(**kwargs: Any) -> Loader:
    source = functools.partial(P.slow_source, total=48, seconds=0.01)
    return Loader(source, P.cast_step, batch_size=4, num_workers=2, **kwargs)


def test_a_ctrl_c_blocked_in_the_wait_for_a_batch_leaves_the_loader_going() -> None:
    """Nothing was half-done: the workers go on, ``state_dict()`` counts the batches handed
    out (a new loader resumed from it gets the rest), the same iterator goes on with the very
    batch it waited for, and the next ``iter()`` runs the next epoch."""
    seen: list[int] = []
    with make() as loader:
        it = iter(loader)
        seen += P.ids_of(next(it)) + P.ids_of(next(it))
        with ctrl_c_at(blocked_in_wait) as fired, pytest.raises(KeyboardInterrupt):
            while True:  # (a batch already queued needs no wait)
                seen += P.ids_of(next(it))
        assert fired == ["wait"]
        assert not loader.closed
        resume_exactly_once(loader.state_dict(), seen)
        seen += [i for batch in it for i in P.ids_of(batch)]
        assert sorted(seen) == list(range(48)), "the same iterator does not go on exactly"
        assert sorted(i for batch in loader for i in P.ids_of(batch)) == list(range(48))


def resume_exactly_once(state: dict[str, Any], seen: list[int]) -> None:
    """``state`` counts the batches of ``seen``, and a new loader resumed from it delivers
    every other sample of the epoch, once."""
    assert sum(state["received"]) * 4 == len(seen)
    with make() as resumed:
        resumed.load_state_dict(state)
        rest = [i for batch in resumed for i in P.ids_of(batch)]
    assert sorted(seen + rest) == list(range(48))


@pytest.mark.parametrize(
    ("moment", "words"),
    [
        (entering(Router.drain), r"while waiting for batch \d+ .*, handling what the workers sent"),
        (entering(build_batch), r"while handing out batch \d+ of epoch 0 .*not counted"),
    ],
    ids=["handling-a-record", "handing-out"],
)
def test_a_ctrl_c_in_the_middle_of_next_stops_the_workers_and_keeps_the_state(
    moment: Moment, words: str
) -> None:
    """A record half-handled or a batch half-built: the loader stops its workers and says so
    when used again, ``state_dict()`` works and does not count the batch that never reached
    the user, and a new loader resumed from it gets every other sample once."""
    with make() as loader:
        it = iter(loader)
        seen = P.ids_of(next(it)) + P.ids_of(next(it))
        with ctrl_c_at(moment) as fired, pytest.raises(KeyboardInterrupt):
            while True:  # (a batch already queued needs no record handled)
                seen += P.ids_of(next(it))
        assert fired
        assert loader.closed
        with pytest.raises(LoaderClosedError, match=f"interrupted by KeyboardInterrupt {words}"):
            next(it)
        state = loader.state_dict()
    resume_exactly_once(state, seen)


def test_a_ctrl_c_while_a_resumed_epoch_starts_keeps_the_loaded_state() -> None:
    """Interrupted while its workers move to the loaded position: the state is still the one
    loaded, so a third run goes on from it exactly once."""
    with make() as loader:
        it = iter(loader)
        seen = [i for _ in range(3) for i in P.ids_of(next(it))]
        state = loader.state_dict()
    with make() as interrupted:
        interrupted.load_state_dict(state)
        with ctrl_c_at(entering(Coordinator.seek)) as fired, pytest.raises(KeyboardInterrupt):
            next(iter(interrupted))
        assert fired == ["seek"]
        again = interrupted.state_dict()
    assert again["received"] == state["received"] and again["epoch"] == 0
    with make() as resumed:
        resumed.load_state_dict(again)
        rest = [i for batch in resumed for i in P.ids_of(batch)]
    assert sorted(seen + rest) == list(range(48))


# ------------------------------------------------------------------ processes as they start
STORM_TRAINER = """
import functools, signal, sys
from loader import Loader
from tests import pipelines as P

received = []


def main(start_method):
    signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    print("go", flush=True)
    source = functools.partial(P.sample_source, total=32)
    loader = Loader(source, P.cast_step, batch_size=4, num_workers=2, start_method=start_method)
    with loader:
        ids = sorted(i for batch in loader for i in P.ids_of(batch))
    assert ids == list(range(32)), ids
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (Python's exit would restore the default)
    print("done", len(received), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
"""


@pytest.mark.parametrize(
    ("start_method", "server"), [("forkserver", "exec"), ("spawn", "")], ids=["server", "spawn"]
)
def test_sigint_while_the_server_and_workers_start_kills_none_of_them(
    tmp_path: Path, start_method: str, server: str
) -> None:
    """SIGINT to the group every few milliseconds while a fresh worker server (a new
    interpreter) or spawned workers start: they start with the signal blocked and ignore it
    before they unblock it, so none dies of it with a traceback; the trainer (its own
    handler counts them) gets every one of them and its batches."""
    script = tmp_path / "storm.py"
    script.write_text(STORM_TRAINER)
    env = clean_env(**({"DALI_LOADER_SERVER": server} if server else {}))
    trainer = subprocess.Popen(
        [sys.executable, str(script), start_method],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        assert trainer.stdout is not None
        assert trainer.stdout.readline().strip() == "go"
        sent = 0
        while trainer.poll() is None and sent < 4000:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(trainer.pid, signal.SIGINT)
                sent += 1
            time.sleep(0.005)
        out, err = trainer.communicate(timeout=120)
    finally:
        trainer.kill()
    assert trainer.returncode == 0, out + err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert out.split()[0] == "done" and int(out.split()[1]) > 10, out
    assert _group_gone(trainer.pid, 20)
