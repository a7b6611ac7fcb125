"""The leak_check fixture shipped to users through the pytest11 entry point."""

from __future__ import annotations

import textwrap

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
