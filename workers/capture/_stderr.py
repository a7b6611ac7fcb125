"""What native code prints on the worker's stderr while a failed batch is re-run. Runs in the
worker, on its main thread.

DALI's decoders log to file descriptor 2 themselves (nvImageCodec prints ``[ERROR] [jpeg_parser]
Invalid marker`` for a corrupt JPEG), below Python. When a batch fails, the worker re-runs its
samples one by one to find the failing ones (:mod:`workers.capture._isolation`), and each failing
sample prints those lines again. :func:`repeats_captured` holds them back: such log lines become
part of the error the trainer raises, and anything else printed in the block still reaches
stderr, after it.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field

#: a native library's log line: its level in brackets, in colour or not
_NATIVE_LOG = re.compile(r"^\[(ERROR|WARNING|WARN|INFO|DEBUG|FATAL|TRACE)\]\s*(.*\S)\s*$")
_COLOURS = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class Printed:
    """What a block printed on stderr that was held back: native log lines, without their level
    or colours (``[jpeg_parser] Invalid marker``), in order, each once."""

    native: list[str] = field(default_factory=list)


def native_line(line: str) -> tuple[str, str] | None:
    """``line`` as a native log line: its level and its text without the level or colours
    (``("ERROR", "[jpeg_parser] Invalid marker")``); None when it is no such line."""
    found = _NATIVE_LOG.match(_COLOURS.sub("", line).strip())
    return None if found is None else (found.group(1), found.group(2))


def split_native(text: str) -> tuple[list[str], str]:
    """``text`` as its native log lines (level and colours stripped, each once) and the rest."""
    native: list[str] = []
    rest: list[str] = []
    for line in text.splitlines(keepends=True):
        found = native_line(line)
        if found is None:
            rest.append(line)
        elif found[1] not in native:
            native.append(found[1])
    return native, "".join(rest)


@contextlib.contextmanager
def repeats_captured() -> Iterator[Printed]:
    """Run a block with file descriptor 2 sent to a temporary file. Native log lines printed in
    it come back in the :class:`Printed` (filled when the block ends); anything else (a user's
    ``print`` to stderr, another thread's output) is written to stderr when the block ends. A
    process whose descriptor 2 cannot be duplicated runs the block as it is."""
    printed = Printed()
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:
        yield printed
        return
    try:
        with tempfile.TemporaryFile() as held:
            os.dup2(held.fileno(), 2)
            try:
                yield printed
            finally:
                with contextlib.suppress(Exception):
                    sys.stderr.flush()
                os.dup2(saved, 2)
                held.seek(0)
                native, rest = split_native(held.read().decode("utf-8", "replace"))
                printed.native[:] = native
                if rest:
                    with contextlib.suppress(OSError), open(2, "wb", closefd=False) as stderr:
                        stderr.write(rest.encode("utf-8", "replace"))
    finally:
        os.close(saved)
