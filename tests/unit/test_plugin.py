"""The leak_check fixture shipped to users through the pytest11 entry point."""

from __future__ import annotations

import pytest


def test_leak_check_fails_a_test_that_leaves_a_process(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import subprocess, sys

        def test_clean(leak_check):
            subprocess.run([sys.executable, "-c", "pass"], check=True)

        def test_leaky(leak_check):
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(8)"])
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:xdist", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*resource leak: child processes still alive*"])
