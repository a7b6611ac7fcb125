"""DALI's native log lines held on a worker's stderr (:mod:`workers.capture._native_lines`), each
case in a process of its own whose descriptor 2 the relay takes over, as a worker's."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
ERROR = "\x1b[0;31m[ERROR] \x1b[0m[jpeg_parser] Invalid marker\n"
WARNING = "[WARNING] [resize] slow path\n"


def run(body: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    code = "import os, sys\nfrom workers.capture._native_lines import NativeLines\n"
    code += "lines = NativeLines()\nlines.open()\nassert lines.active\n"
    code += "def native(text):\n    os.write(2, text.encode())\n"
    code += textwrap.dedent(body) + "\nlines.close()\n"
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done


def test_a_native_line_waits_for_later_batches_and_other_output_does_not() -> None:
    done = run(
        f"""
        native({ERROR!r})
        print("python's own", file=sys.stderr)
        lines.release()  # (reads up to here)
        native({WARNING!r})
        for _ in range(3):
            lines.batch_done()
            sys.stderr.write("batch\\n"); sys.stderr.flush()
        """
    )
    # the error line (held before release) came out after the print; the warning after
    # three more batches
    assert done.stderr.splitlines() == [
        "python's own",
        ERROR.strip("\n"),
        "batch",
        "batch",
        WARNING.strip("\n"),
        "batch",
    ]


def test_lines_of_skipped_samples_are_dropped_and_the_rest_kept() -> None:
    done = run(
        f"""
        native({ERROR!r})
        native({WARNING!r})
        lines.drop(["[jpeg_parser] Invalid marker"], ("a.tar:1",))
        native({ERROR!r})  # (a later copy)
        """
    )
    assert done.stderr == WARNING


def test_whatever_is_held_reaches_stderr_when_the_relay_closes() -> None:
    done = run(f"native({ERROR!r})\nnative('[INFO] [x] not held\\n')")
    assert done.stderr == "[INFO] [x] not held\n" + ERROR


def test_python_output_reaches_stderr_while_the_process_still_runs() -> None:
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys\nfrom workers.capture._native_lines import NativeLines\n"
            "lines = NativeLines()\nlines.open()\n"
            "sys.stderr.write('first\\n'); sys.stderr.write('no end yet'); sys.stderr.flush()\n"
            "sys.stdin.readline()\nlines.close()\n",
        ],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdin is not None and process.stderr is not None
    try:
        assert process.stderr.readline() == "first\n"  # (before the process reads stdin)
        assert process.stderr.read(len("no end yet")) == "no end yet"  # a partial line too
    finally:
        process.stdin.write("\n")
        process.stdin.close()
        assert process.wait(30) == 0


def test_a_flood_neither_blocks_nor_loses_output() -> None:
    done = run(
        """
        for index in range(3000):  # (more than MAX_HELD native lines)
            sys.stderr.write("x" * 300 + f" {index}\\n")
            native("[ERROR] [op] failure %d\\n" % index)
        sys.stderr.flush()
        """
    )
    lines = done.stderr.splitlines()
    assert [line for line in lines if line.startswith("x")] == [
        "x" * 300 + f" {index}" for index in range(3000)
    ]
    assert [line for line in lines if line.startswith("[ERROR]")] == [
        f"[ERROR] [op] failure {index}" for index in range(3000)
    ]
