"""The forkserver's worker server (loader._server): how it starts, what it imports, and that
the workers it forks need not import the main module again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loader import _config

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]

#: A main script whose every import outside the trainer is counted (a line in imports.txt per
#: process that imports it under another name than __main__), with {top} at its top.
SCRIPT = """
{top}
import json
import os
import sys

if __name__ != "__main__":
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "imports.txt"), "a") as f:
        f.write(f"{{os.getpid()}} {{__name__}}\\n")

import numpy as np

from loader import Loader, _server


class Ids:
    def __init__(self, shard):
        self.mine = list(range(shard.index, 32, shard.count))

    def __iter__(self):
        import nvidia.dali.experimental.dynamic as ndd

        for start in range(0, len(self.mine), 4):
            yield ndd.as_batch([np.array([i]) for i in self.mine[start:start + 4]])


def ids(shard):  # DALI is imported in the workers only
    import nvidia.dali.experimental.dynamic as ndd

    return ndd.ExternalSource(Ids(shard), cycle="raise")


def step(batch):
    import nvidia.dali.experimental.dynamic as ndd

    return {{"id": ndd.cast(batch, dtype=ndd.int64)}}


def main():
    pids = []
    for _ in range(2):
        with Loader(ids, step, batch_size=4, start_method="forkserver") as loader:
            got = sorted(int(v) for b in loader for v in np.asarray(b["id"]).ravel())
            assert got == list(range(32)), got
            pids += loader.worker_pids()
    print(json.dumps({{"how": _server.started_how(), "server": _server.server_pid(),
                       "workers": pids}}))


if __name__ == "__main__":
    main()
"""


def run_script(tmp_path: Path, top: str, server: str | None) -> tuple[dict[str, object], list[str]]:
    script = tmp_path / "main_script.py"
    script.write_text(SCRIPT.format(top=top))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DALI_LOADER_")}
    env["PYTHONPATH"] = str(ROOT)
    if server is not None:
        env["DALI_LOADER_SERVER"] = server
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=200,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    imports = tmp_path / "imports.txt"
    lines = imports.read_text().split("\n") if imports.exists() else []
    return json.loads(done.stdout.strip().splitlines()[-1]), [line for line in lines if line]


def test_a_fresh_server_imports_the_main_module_once_as_mp_main(tmp_path: Path) -> None:
    """exec: the server imports the script once, as __mp_main__ (its __main__ block does not
    run there); the four workers of two loaders import it no more."""
    found, imports = run_script(tmp_path, "import numpy", "exec")
    assert found["how"] == "exec"
    assert [line.split()[1] for line in imports] == ["__mp_main__"], imports
    assert imports[0].split()[0] == str(found["server"])


def test_a_server_forked_from_the_trainer_imports_nothing_again(tmp_path: Path) -> None:
    """fork (chosen by default where safe): the script is never imported again, and the workers
    are the server's children."""
    found, imports = run_script(tmp_path, "import numpy", None)
    assert found["how"] == "fork"
    assert imports == []
    assert len(found["workers"]) == 4  # type: ignore[arg-type]


def test_the_server_is_not_forked_from_a_trainer_that_imported_dali(tmp_path: Path) -> None:
    found, imports = run_script(tmp_path, "import nvidia.dali.experimental.dynamic", None)
    assert found["how"] == "exec"
    assert len(imports) == 1


def test_a_forced_fork_is_refused_when_unsafe(tmp_path: Path) -> None:
    script = tmp_path / "main_script.py"
    script.write_text(SCRIPT.format(top="import nvidia.dali.experimental.dynamic"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DALI_LOADER_")}
    env.update(PYTHONPATH=str(ROOT), DALI_LOADER_SERVER="fork")
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=200, env=env
    )
    assert done.returncode != 0
    assert "DALI was imported in this process" in done.stderr


def test_the_default_start_method(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_config.START_METHOD_ENV, raising=False)
    previous = _config.set_default_start_method(None)
    try:
        assert _config._check_start_method(None) == "spawn"
        monkeypatch.setenv(_config.START_METHOD_ENV, "forkserver")
        assert _config._check_start_method(None) == "forkserver"
        assert _config._check_start_method("spawn") == "spawn"
        monkeypatch.setenv(_config.START_METHOD_ENV, "fork")
        with pytest.raises(ValueError, match="DALI_LOADER_START_METHOD='fork'"):
            _config._check_start_method(None)
        _config.set_default_start_method("spawn")
        assert _config._check_start_method(None) == "spawn"  # the process's default first
    finally:
        _config.set_default_start_method(previous)


class MarkBatches:
    """One batch of 4 samples, each the value of LOADER_TEST_MARK in the worker."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        import numpy as np
        import nvidia.dali.experimental.dynamic as ndd

        mark = int(os.environ.get("LOADER_TEST_MARK", "0"))
        yield ndd.as_batch([np.array([mark], dtype=np.int64)] * 4)


def mark_source(shard: object) -> object:
    import nvidia.dali.experimental.dynamic as ndd

    return ndd.ExternalSource(MarkBatches(), cycle="raise")


def mark_step(batch: object) -> dict[str, object]:
    import nvidia.dali.experimental.dynamic as ndd

    return {"mark": ndd.cast(batch, dtype=ndd.int64)}


def marks(monkeypatch: pytest.MonkeyPatch, value: str) -> set[int]:
    from loader import Loader

    monkeypatch.setenv("LOADER_TEST_MARK", value)
    with Loader(
        mark_source, mark_step, batch_size=4, num_workers=1, start_method="forkserver"
    ) as loader:
        return {int(v) for b in loader for v in b["mark"].ravel()}


def test_forked_workers_get_the_trainers_environment_of_now(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As a spawned worker does: a variable set after the server started reaches the workers."""
    assert marks(monkeypatch, "3") == {3}
    assert marks(monkeypatch, "5") == {5}
