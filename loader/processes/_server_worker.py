"""A worker forked by the worker server, as the pool sees it. Runs in the trainer.

:class:`ServerWorker` has the part of ``multiprocessing.Process``'s interface that the pool and
the coordinator use (``pid``, ``sentinel``, ``exitcode``, ``join``, ``is_alive``, ``close``). Its
``start()`` sends the server a :class:`ipc.server_wire.Fork` with the worker's descriptors, reads
the pid from the worker's status socket, then writes the worker's
:class:`ipc.server_wire.WorkerStart` (the trainer's environment, directory and path of now, and
the pickled spec) to its start pipe. The status socket is the sentinel: the server writes the
exit code there once it has reaped the worker (end of stream: the server is gone).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import socket
import sys
import time
from collections.abc import Sequence
from multiprocessing.connection import wait
from typing import Any

from ipc import server_wire as sw

from ..errors import StartupError
from .server import REPLY_TIMEOUT, WorkerServer


class ServerWorker:
    """A worker forked by the server, with the part of ``multiprocessing.Process``'s interface
    the pool uses. ``sentinel`` (its status socket) becomes readable when the server reports its
    exit code, or when the server is gone (exit code :data:`ipc.server_wire.SERVER_GONE`)."""

    def __init__(
        self,
        server: WorkerServer,
        name: str,
        spec: Any,
        fds: Sequence[int],
        environ: dict[str, str],
    ) -> None:
        self.name = name
        self._server = server
        self._start = sw.WorkerStart(
            environ=environ,
            cwd=os.getcwd(),
            sys_path=tuple(sys.path),
            spec=pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL),
        )
        self._fds = list(fds)
        self._status: socket.socket | None = None
        self._pid: int | None = None
        self._exitcode: int | None = None

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def sentinel(self) -> int:
        if self._status is None:
            raise ValueError("the worker was not started, or is closed")
        return self._status.fileno()

    def start(self) -> None:
        """Ask the server to fork the worker, wait for its pid (bounded by
        :data:`REPLY_TIMEOUT`), then hand the worker its start record."""
        ours, theirs = socket.socketpair()
        start_read, start_write = os.pipe()
        try:
            try:
                self._server.send(sw.Fork(self.name), [theirs.fileno(), start_read, *self._fds])
            except OSError as error:
                raise StartupError(
                    f"the loader's worker server (pid {self._server.pid}) is gone ({error}); "
                    "its error is on stderr above. The next Loader starts a new one; "
                    "start_method='spawn' starts workers without it"
                ) from error
            finally:
                theirs.close()
                os.close(start_read)
            self._status = ours
            pid = self._read_status(REPLY_TIMEOUT)
            if pid is None:
                raise StartupError(
                    f"the loader's worker server (pid {self._server.pid}) did not fork "
                    f"{self.name} within {REPLY_TIMEOUT:g} s: it imports the main module first "
                    "(is its top level waiting for something?); start_method='spawn' starts "
                    "workers without it"
                )
            if pid < 0:
                raise StartupError(
                    f"the loader's worker server (pid {self._server.pid}) exited before it "
                    f"forked {self.name}; its error is on stderr above. start_method='spawn' "
                    "starts workers without it"
                )
            self._pid = pid
            with contextlib.suppress(BrokenPipeError):  # it died at once: its exit code tells
                os.write(start_write, pickle.dumps(self._start, protocol=pickle.HIGHEST_PROTOCOL))
        except BaseException:
            ours.close()
            self._status = None
            raise
        finally:
            os.close(start_write)

    def _read_status(self, timeout: float) -> int | None:
        """The next integer from the server: None when nothing came within ``timeout``, -1 at
        end of stream (the server is gone)."""
        assert self._status is not None
        deadline = time.monotonic() + timeout
        data = b""
        while len(data) < sw.STATUS.size:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self._status], [], [], remaining)[0]:
                return None
            chunk = self._status.recv(sw.STATUS.size - len(data))
            if not chunk:
                return -1
            data += chunk
        return int(sw.STATUS.unpack(data)[0])

    @property
    def exitcode(self) -> int | None:
        if (
            self._exitcode is None
            and self._status is not None
            and self._pid is not None
            and select.select([self._status], [], [], 0)[0]
        ):
            code = self._read_status(1.0)
            if code is not None:
                self._exitcode = sw.SERVER_GONE if code == -1 else code
        return self._exitcode

    def join(self, timeout: float | None = None) -> None:
        if self._status is None or self._exitcode is not None:
            return
        wait([self._status], timeout)
        _ = self.exitcode

    def is_alive(self) -> bool:
        return self._pid is not None and self.exitcode is None

    def close(self) -> None:
        """Release the status socket; a ``ValueError`` while the worker runs (as
        ``multiprocessing.Process.close``)."""
        if self._pid is not None and self.exitcode is None:
            raise ValueError(f"{self.name} is still running")
        if self._status is not None:
            self._status.close()
            self._status = None
