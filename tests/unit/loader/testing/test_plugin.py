"""The leak_check fixture shipped to users through the pytest11 entry point."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest


def run_inner(pytester: pytest.Pytester, source: str) -> pytest.RunResult:
    """Run ``source`` as a test file in a fresh pytest process that loads the plugin."""
    pytester.makepyfile(textwrap.dedent(source))
    return pytester.runpytest_subprocess("-p", "no:xdist", "-p", "no:cacheprovider")


def test_leak_check_fails_a_test_that_leaves_a_process(pytester: pytest.Pytester) -> None:
    result = run_inner(
        pytester,
        """
        import subprocess, sys

        def test_clean(leak_check):
            subprocess.run([sys.executable, "-c", "pass"], check=True)

        def test_leaky(leak_check):
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(8)"])
        """,
    )
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*resource leak: child processes still alive*"])


# Each case: code that opens the resource into ``held`` (a list), and code that closes it again.
# The leaky test keeps ``held`` alive at module level, as a leaked loader resource would be; the
# clean test opens and closes the same resource and must pass.
LEAKS = {
    "memfd": (
        "held.append(os.memfd_create('leak_check_probe'))",
        "os.close(held.pop())",
    ),
    "socket": (
        "held.extend(socket.socketpair())",
        "[s.close() for s in held]; held.clear()",
    ),
}


@pytest.mark.parametrize("kind", sorted(LEAKS))
def test_leak_check_fails_a_test_that_leaves_a_descriptor(
    pytester: pytest.Pytester, kind: str
) -> None:
    open_it, close_it = LEAKS[kind]
    result = run_inner(
        pytester,
        f"""
        import os, socket

        LEAKED = []

        def test_clean(leak_check):
            held = []
            {open_it}
            {close_it}

        def test_leaky(leak_check):
            held = LEAKED
            {open_it}
        """,
    )
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_leaky*",
            f"resource leak: file descriptors left open ({kind}): *",
        ],
        consecutive=True,
    )
    result.stdout.no_fnmatch_line("*ERROR at teardown of test_clean*")


def test_leak_check_blames_a_dev_shm_entry_the_test_left(pytester: pytest.Pytester) -> None:
    """One made and closed but not unlinked (held by nobody), and one still mapped by the test
    process, are both the test's leaks; the same made and removed is not."""
    result = run_inner(
        pytester,
        """
        import os
        import pytest
        from multiprocessing import shared_memory

        KEPT = []

        @pytest.fixture
        def orphan():
            # (unlinked right after leak_check's teardown: a concurrent test session on this
            # machine cannot tell it from its own for longer than this test lasts)
            path = f"/dev/shm/leak_check_orphan_{os.getpid()}"
            yield path
            os.unlink(path)

        def test_clean(leak_check):
            path = f"/dev/shm/leak_check_clean_{os.getpid()}"
            open(path, "w").close()
            os.unlink(path)

        def test_orphan(orphan, leak_check):
            open(orphan, "w").close()

        def test_mapped(leak_check):
            memory = shared_memory.SharedMemory(create=True, size=4096, name=f"lc_{os.getpid()}")
            KEPT.append(memory)

        def test_zz_cleanup():
            KEPT.pop().unlink()
        """,
    )
    result.assert_outcomes(passed=4, errors=2)
    result.stdout.fnmatch_lines(
        ["*ERROR at teardown of test_orphan*", "*/dev/shm entries left behind: ['leak_check_orph*"]
    )
    result.stdout.fnmatch_lines(
        ["*ERROR at teardown of test_mapped*", "*/dev/shm entries left behind: ['lc_*"]
    )


def test_leak_check_does_not_blame_another_jobs_dev_shm_entry(pytester: pytest.Pytester) -> None:
    """A /dev/shm entry that appears during the test, made and held by a process outside the
    test's process tree (as a concurrent job's semaphores are), is not the test's leak."""
    result = run_inner(
        pytester,
        """
        import os, signal, subprocess, sys, time

        HOLDER = '''
        import os, sys, time
        if os.fork():
            os._exit(0)  # the holder is reparented: outside the test's process tree
        fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR)
        print(os.getpid(), flush=True)
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 1)  # the test's pipe closes: it goes on without waiting for the holder
        os.dup2(null, 2)
        time.sleep(60)
        '''

        def test_other_job(leak_check):
            path = f"/dev/shm/leak_check_other_{os.getpid()}"
            started = subprocess.run(
                [sys.executable, "-c", HOLDER, path], capture_output=True, text=True, check=True
            )
            test_other_job.holder = int(started.stdout.split()[0])
            assert os.path.exists(path)

        def test_zz_cleanup():
            os.kill(test_other_job.holder, signal.SIGKILL)
            os.unlink(f"/dev/shm/leak_check_other_{os.getpid()}")
        """,
    )
    result.assert_outcomes(passed=2)


SERVER_SUITE = {
    "steps.py": """
        import nvidia.dali.experimental.dynamic as ndd
        import numpy as np

        OFFSET = 0  # a test changes it in the test process: workers must not see it

        class Ids:
            def __init__(self, shard):
                self.ids = list(range(shard.index, 32, shard.count))

            def __iter__(self):
                for start in range(0, len(self.ids), 4):
                    chunk = self.ids[start:start + 4]
                    yield ndd.as_batch([np.array([i + OFFSET]) for i in chunk])

        def source(shard):
            return ndd.ExternalSource(Ids(shard), cycle="raise")

        def step(ids):
            return {"id": ndd.cast(ids, dtype=ndd.int64)}
        """,
    "test_suite.py": """
        import os
        import psutil
        import pytest
        from loader import Loader
        from loader.processes import server as _server
        import steps

        SERVERS = []

        def test_aa_server_before_any_loader():
            with open(os.path.join(os.path.dirname(__file__), "early.txt"), "a") as out:
                out.write(f"{os.getpid()} {_server.server_pid()}\\n")

        @pytest.mark.parametrize("n", range(4))
        def test_loader(leak_check, monkeypatch, n):
            monkeypatch.setattr(steps, "OFFSET", 1000 + n)
            with Loader(steps.source, steps.step, batch_size=4, num_workers=2) as loader:
                ids = sorted(int(v) for b in loader for v in b["id"].ravel())
                parents = {psutil.Process(pid).ppid() for pid in loader.worker_pids()}
            assert ids == list(range(32))
            assert loader.config.start_method == "forkserver"
            assert parents == {_server.server_pid()}
            SERVERS.append(_server.server_pid())
            with open(os.path.join(os.path.dirname(__file__), "servers.txt"), "a") as out:
                out.write(f"{os.getpid()} {SERVERS[-1]}\\n")

        def test_one_server_per_process():
            assert len(set(SERVERS)) <= 1
        """,
}


def read_pairs(path: Path) -> set[tuple[str, str]]:
    lines = path.read_text().split("\n") if path.exists() else []
    return {(line.split()[0], line.split()[1]) for line in lines if line}


@pytest.mark.parametrize(
    ("xdist", "option"),
    [
        (False, None),
        (True, None),
        (False, "--loader-worker-server"),
        (False, "--no-loader-worker-server"),
    ],
    ids=["serial", "xdist", "flag", "no-flag"],
)
def test_a_suite_gets_one_worker_server_per_test_process(
    pytester: pytest.Pytester, xdist: bool, option: str | None
) -> None:
    """By default (and with --loader-worker-server): the plugin starts one worker server per
    test process (one per xdist worker under -n 2) before the first test, Loaders made without
    start_method fork their workers from it, leak_check stays green, and a test's monkeypatch
    does not reach any worker (they are forked from the session as it was before the tests).
    With --no-loader-worker-server the first Loader starts it instead."""
    import textwrap

    for name, text in SERVER_SUITE.items():
        pytester.path.joinpath(name).write_text(textwrap.dedent(text))
    arguments = ["-p", "no:cacheprovider", *([option] if option else [])]
    arguments += ["-n", "2"] if xdist else ["-p", "no:xdist"]
    result = pytester.runpytest_subprocess(*arguments, timeout=240)
    result.assert_outcomes(passed=6)
    pairs = read_pairs(pytester.path / "servers.txt")
    processes = {process for process, _server in pairs}
    servers = {server for _process, server in pairs}
    # (4 tests build loaders; xdist's scheduler, on a busy machine, may hand them all to one
    # worker, so under -n 2 one or two test processes build)
    assert 1 <= len(processes) <= (2 if xdist else 1), pairs
    assert len(servers) == len(processes), pairs  # one server per test process, none shared
    early = read_pairs(pytester.path / "early.txt")
    if option == "--no-loader-worker-server":
        assert early == {(process, "None") for process, _ in early}
    else:
        assert early <= pairs, (early, pairs)  # running before the first test, and the one used


def test_the_resource_trackers_pipe_is_not_a_leak(pytester: pytest.Pytester) -> None:
    """multiprocessing's resource tracker, started by a test, keeps a pipe to it open in the
    test process for good: leak_check knows it as the helper's (the same pipe is open in the
    helper process), and still sees a pipe the test leaves."""
    result = run_inner(
        pytester,
        """
        import os
        from multiprocessing import shared_memory

        LEAKED = []

        def test_tracker_started(leak_check):
            memory = shared_memory.SharedMemory(create=True, size=4096)
            memory.close()
            memory.unlink()

        def test_leaky_pipe(leak_check):
            LEAKED.extend(os.pipe())
        """,
    )
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_leaky_pipe*"])
    result.stdout.no_fnmatch_line("*ERROR at teardown of test_tracker_started*")
