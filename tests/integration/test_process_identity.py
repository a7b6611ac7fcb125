"""The loader's processes keep the identity they inherited: a worker server and its workers show
their titles in ``ps`` and keep their environment (``/proc/<pid>/environ``), which cluster tools
attribute processes to jobs by. Real loaders, real worker processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from workers.process._title import fit, server_title, short_name, worker_title

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]
MARKER = "DALI_CAPTURE_TEST_JOB_MARKER"
#: The command line's room for a title in the ``python -`` case: more than a worker's name
#: (``dali-loader-worker-0``, 20), less than any whole title (``… (trainer N)``, 30 and more).
HEREDOC_ROOM = 24

#: A trainer that holds a batch and writes, for every process it started, what ``ps`` and the
#: cluster's tools see: its environment, command line and short name, read from /proc.
HOLD = """
import json, sys
import psutil
import loader
from loader import Loader
from tests import pipelines as P

def seen(process):
    return {
        "pid": process.pid,
        "environ": process.environ(),
        "cmdline": process.cmdline(),
        "name": process.name(),
        "room": len(open(f"/proc/{process.pid}/cmdline", "rb").read()) - 2,
    }

if __name__ == "__main__":
    with Loader(P.sample_source, P.cast_step, batch_size=4, num_workers=2) as held:
        next(iter(held))
        me = psutil.Process()
        found = {
            "trainer": seen(me),
            "server": loader.worker_server_pid(),
            "workers": held.worker_pids(),
            "children": [seen(c) for c in me.children(recursive=True)],
        }
        print(json.dumps(found))
"""


def _hold(tmp_path: Path, how: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DALI_LOADER_", "SPT_"))}
    env.update(PYTHONPATH=str(ROOT), **{MARKER: "job-4711"})
    script = tmp_path / "a-trainer-script-with-a-long-enough-name.py"
    script.write_text(HOLD)
    if how == "script":
        command, cwd = [sys.executable, str(script)], tmp_path
    else:
        # ``python -`` started by a path of a known length, so that the command line has room
        # for the processes' names and not for their whole titles wherever the suite runs
        # (the interpreter's own path is as long as the machine made it: 27 characters here,
        # 37 in another checkout). ``.//…/python`` from the interpreter's folder is the same
        # interpreter (and the same venv).
        name = Path(sys.executable).name
        command = ["./" + "/" * (HEREDOC_ROOM - 3 - len(name)) + name, "-"]
        cwd = Path(sys.executable).parent
    done = subprocess.run(
        command,
        input=None if how == "script" else HOLD,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=200,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    found["env"] = env
    return found


@pytest.mark.parametrize("how", ["script", "heredoc"])
def test_every_loader_process_keeps_its_environment_and_shows_its_title(
    tmp_path: Path, how: str
) -> None:
    """A trainer started with a marker variable holds a batch of a loader of 2 workers: the
    server and each worker read the marker (and exactly the trainer's variables, none added,
    ``SPT_NOENV`` among them) in ``/proc/<pid>/environ``, and show their titles: whole where
    the command line has room (a script), cut to the most useful part where it has not
    (``python -`` reading a heredoc). Before, every one of them read an empty environment."""
    found = _hold(tmp_path, how)
    trainer = found["trainer"]
    assert trainer["environ"].get(MARKER) == "job-4711"
    children = {c["pid"]: c for c in found["children"]}
    server, workers = found["server"], found["workers"]
    assert server in children and len(workers) == 2 and set(workers) <= set(children)
    expected = {server: server_title(trainer["pid"])}
    expected.update({pid: worker_title(k, trainer["pid"]) for k, pid in enumerate(workers)})
    for pid, child in children.items():
        environ = child["environ"]
        assert environ.get(MARKER) == "job-4711", (pid, child["cmdline"], len(environ))
        assert "SPT_NOENV" not in environ, pid
        added = set(environ) - set(trainer["environ"])
        assert not added, (pid, added)
        if pid not in expected:  # (a helper the loader started: none expected here)
            continue
        title = " ".join(" ".join(child["cmdline"]).split())
        assert title == fit(expected[pid], child["room"]), (pid, title, child["room"])
        assert child["name"] == short_name(expected[pid]) or child["name"] == title.split()[0]
    titles = [" ".join(" ".join(children[pid]["cmdline"]).split()) for pid in expected]
    if how == "script":  # (the script's path leaves room for the whole titles)
        assert titles == list(expected.values())
    else:  # "python -" by a short path: the names alone
        assert {c["room"] for c in children.values()} == {HEREDOC_ROOM}
        assert all(not t.endswith(")") and t.startswith("dali-loader") for t in titles), titles
