"""DALI's native log lines on the worker's stderr, held until their batch's outcome is known.
Runs in the worker: opened and closed around the worker's life by the process setup
(:mod:`workers.process`), told of each published batch and of each skip by the command loop
(:mod:`._loop`), on the main thread; a thread of its own reads the pipe.

DALI's C++ code logs to file descriptor 2 itself (nvImageCodec prints ``[ERROR] [jpeg_parser]
Invalid marker``, in colour, for a corrupt JPEG). Under ``on_error="skip"`` such a line belongs to
a sample the loader leaves out and names in its own log line; printed raw, before that line, it
reads as an error nobody handled. :class:`NativeLines` sends descriptor 2 through a pipe that its
thread reads:

* anything that is not a native ``[ERROR]``/``[WARNING]`` line (Python's tracebacks and prints,
  other log levels, other libraries' output) goes on to the real stderr as it comes;
* such a native line is held until :data:`HELD_BATCHES` more batches were published after it was
  read (DALI's prefetch runs the next batch while a step is published, so a line may belong to a
  batch after the one in flight), then written to stderr;
* when the loader skips samples (:meth:`NativeLines.drop`), the held lines those samples printed
  when run alone (:mod:`._isolation`) are dropped, logged at DEBUG, and so is any later copy;
* everything still held when the worker reports a failure or ends (:meth:`NativeLines.release`)
  is written then: the lines of an error that is raised, not skipped, reach the user before the
  trainer's exception.

Only the thread writes to the real stderr, so output keeps its order (but the lines held on
purpose); it never writes to descriptor 2, which it reads, and logs nothing. The main thread tells
it of a published batch, a skip or a release by a mark line written to descriptor 2 (so the thread
acts on it in the order of the output), and waits for a mark only when it must know what was
printed before it (:meth:`NativeLines.drop`, :meth:`NativeLines.release`), with a limit. A writer
never waits on the held lines: the pipe is read as fast as it fills.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import sys
import threading
from dataclasses import dataclass

from ._stderr import native_line

logger = logging.getLogger("workers")

#: a held native line is written once this many batches were published after it was read
HELD_BATCHES = 3
#: the most lines held at once (the oldest go on to stderr beyond it)
MAX_HELD = 1000
#: how long a line without its end waits for the rest before it is written as it is (seconds)
PARTIAL_WAIT = 0.2
#: a partial line this long is written as it is
MAX_PARTIAL = 1 << 16
#: how long :meth:`NativeLines.close` and :meth:`NativeLines.drop` wait for the thread (seconds)
WAIT_LIMIT = 5.0
#: the levels of the native lines that are held
HELD_LEVELS = frozenset({"ERROR", "WARNING", "WARN"})
#: the line the main thread writes to the pipe to know when the thread has read up to it
_MARK = b"\x00native-lines-mark "


@dataclass
class _Held:
    """A native line held back: the batches published when it was read, its bytes, its text
    without level or colours."""

    published: int
    line: bytes
    text: str


class NativeLines:
    """Descriptor 2 of this process through a pipe (see the module docstring). Until
    :meth:`open`, and where the descriptors cannot be set up, every method does nothing."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._held: list[_Held] = []
        self._published = 0
        self._dropping: set[str] = set()
        self._dropped: list[str] = []  # (the thread's, for the main thread's log)
        self._marks_seen = 0
        self._marks_sent = 0
        self._real: int | None = None  # the real stderr
        self._read: int | None = None  # the pipe's end the thread reads
        self._thread: threading.Thread | None = None

    @property
    def active(self) -> bool:
        return self._thread is not None

    def open(self) -> None:
        """Send descriptor 2 through the pipe and start the thread that reads it."""
        if self._thread is not None:
            return
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        try:
            real = os.dup(2)
        except OSError:
            return
        try:
            read, write = os.pipe()
        except OSError:
            os.close(real)
            return
        try:
            os.dup2(write, 2)
        except OSError:
            for fd in (real, read):
                os.close(fd)
            return
        finally:
            os.close(write)
        self._real, self._read = real, read
        self._thread = threading.Thread(target=self._pump, name="native-lines", daemon=True)
        self._thread.start()

    def batch_done(self) -> None:
        """A batch was published: the held lines that are old enough are written (by the
        thread, in their order among the rest)."""
        if self._thread is not None:
            self._mark(b"batch")

    def drop(self, printed: list[str], names: tuple[str, ...]) -> None:
        """The loader skips the samples ``names``, which printed the native lines ``printed``
        (their text, as :func:`~._stderr.native_line` gives it) when run alone: those lines,
        held now or read later, are not written (those held now are logged at DEBUG)."""
        if self._thread is None or not printed:
            return
        with self._lock:
            self._dropping.update(printed)
        self._wait(self._mark(b"sync"))  # (what was written before now is read)
        with self._lock:
            dropped = self._dropped + [h.text for h in self._held if h.text in self._dropping]
            self._held = [held for held in self._held if held.text not in self._dropping]
            self._dropped = []
        if dropped:
            logger.debug(
                "DALI's lines for %s, which the loader skips, kept off stderr: %s",
                ", ".join(names),
                "; ".join(dict.fromkeys(dropped)),
            )

    def release(self) -> None:
        """Write every line held now and every one written to descriptor 2 before now (but
        dropped lines): the worker is about to report a failure or to end, and may be ended
        before :meth:`close`."""
        if self._thread is not None:
            self._wait(self._mark(b"release"))

    def close(self) -> None:
        """Give descriptor 2 back; the thread reads the pipe to its end, writes what is still
        held (but dropped lines) and ends."""
        thread, real, read = self._thread, self._real, self._read
        if thread is None or real is None or read is None:
            return
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        with contextlib.suppress(OSError):
            os.dup2(real, 2)  # the pipe's last write end closes: the thread reads to its end
        thread.join(WAIT_LIMIT)
        self._thread = None
        if not thread.is_alive():
            os.close(read)
            os.close(real)

    # ----------------------------------------------------------------------- the main thread
    def _mark(self, what: bytes) -> int:
        """Write a mark to descriptor 2: the thread acts on it when it reads that far. Its
        number (0: it could not be written)."""
        with self._lock:
            self._marks_sent += 1
            mark = self._marks_sent
        try:
            os.write(2, b"%s%s %d\n" % (_MARK, what, mark))
        except OSError:
            return 0
        return mark

    def _wait(self, mark: int) -> None:
        """Wait (at most :data:`WAIT_LIMIT`) until the thread has read mark ``mark``."""
        with self._lock:
            self._lock.wait_for(lambda: self._marks_seen >= mark, WAIT_LIMIT)

    # ----------------------------------------------------------------------- the thread
    def _pump(self) -> None:
        """Read the pipe until its end: each whole line goes to :meth:`_take`; a line without
        its end is written as it is once nothing followed it for :data:`PARTIAL_WAIT`."""
        read = self._read
        assert read is not None
        pending = b""
        while True:
            try:
                ready, _, _ = select.select([read], [], [], PARTIAL_WAIT if pending else None)
                chunk = os.read(read, 1 << 16) if ready else None
            except OSError:
                break
            if chunk is None or len(pending) > MAX_PARTIAL:
                self._write(pending)  # (a prompt, a progress bar: no log line)
                pending = b""
                if chunk is None:
                    continue
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                self._take(line + b"\n")
        if pending:
            self._take(pending)
        with self._lock:
            rest, self._held = self._held, []
        self._forward(rest)

    def _take(self, line: bytes) -> None:
        """One line read from the pipe: a mark, a native line to hold, or output to write."""
        if line.startswith(_MARK):
            self._on_mark(line[len(_MARK) :].split())
            return
        found = native_line(line.decode("utf-8", "replace"))
        if found is None or found[0] not in HELD_LEVELS:
            self._write(line)
            return
        with self._lock:
            if found[1] in self._dropping:
                self._dropped.append(found[1])
                return
            self._held.append(_Held(self._published, line, found[1]))
            overflow = self._held[:-MAX_HELD]
            del self._held[: len(overflow)]
        self._forward(overflow)

    def _on_mark(self, mark: list[bytes]) -> None:
        """A mark of the main thread (:meth:`_mark`): a batch was published (write the held
        lines old enough), or write everything held (``release``), or nothing (``sync``);
        then the main thread may go on."""
        what, number = mark[0], int(mark[1])
        with self._lock:
            if what == b"batch":
                self._published += 1
                due = [
                    held for held in self._held if held.published <= self._published - HELD_BATCHES
                ]
            else:
                due = list(self._held) if what == b"release" else []
            del self._held[: len(due)]
        self._forward(due)
        with self._lock:
            self._marks_seen = max(self._marks_seen, number)
            self._lock.notify_all()

    def _forward(self, lines: list[_Held]) -> None:
        """Write ``lines`` to stderr, but those of skipped samples."""
        with self._lock:
            kept = [held.line for held in lines if held.text not in self._dropping]
        self._write(b"".join(kept))

    def _write(self, data: bytes) -> None:
        """Write ``data`` to the real stderr, whole."""
        real = self._real
        if not data or real is None:
            return
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(real, view) :]
            except OSError:
                return
