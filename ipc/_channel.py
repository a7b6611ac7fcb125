"""The control channel: small records and file descriptors over one ``socketpair``.

Runs in both processes. The trainer creates the pair with ``multiprocessing.Pipe()`` (an
``AF_UNIX`` socketpair), keeps one end and hands the other to exactly one spawned worker, so the
peer is always our own process. Records are the dataclasses of :mod:`ipc._wire`; file descriptors
(an arena's memfd) go as ``SCM_RIGHTS`` right after the record that announces them.

A clean end of stream (the peer closed or died) raises :class:`ChannelClosed`; callers tell it
apart from a torn message, which raises the underlying ``OSError``/``UnpicklingError``.
"""

from __future__ import annotations

import os
import select
import socket
from multiprocessing.connection import Connection
from typing import Any


class ChannelClosed(EOFError):
    """The peer closed its end of the control channel (or died)."""


class ControlChannel:
    """One end of a worker's control channel. Not thread-safe: one user thread per end."""

    __slots__ = ("_conn", "_poller")

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._poller: select.poll | None = None

    @property
    def connection(self) -> Connection:
        """The underlying connection, for ``multiprocessing.connection.wait``."""
        return self._conn

    @property
    def closed(self) -> bool:
        return self._conn.closed

    def fileno(self) -> int:
        return self._conn.fileno()

    def send(self, message: Any) -> None:
        try:
            self._conn.send(message)
        except (BrokenPipeError, ConnectionResetError) as error:
            raise ChannelClosed("the peer closed the control channel") from error

    def recv(self) -> Any:
        try:
            return self._conn.recv()
        except EOFError as error:
            raise ChannelClosed("the peer closed the control channel") from error
        except ConnectionResetError as error:
            raise ChannelClosed("the peer reset the control channel") from error

    def ready(self) -> bool:
        """True when a record (or EOF) can be read now; one ``poll`` syscall, no allocation.

        ``Connection.poll`` builds a selector on every call, which dominates a tiny batch's cost.
        """
        if self._conn.closed:
            return False
        poller = self._poller
        if poller is None:
            poller = self._poller = select.poll()
            poller.register(self._conn.fileno(), select.POLLIN)
        return bool(poller.poll(0))

    def poll(self, timeout: float | None = 0.0) -> bool:
        try:
            return self._conn.poll(timeout)
        except (EOFError, ConnectionResetError) as error:
            raise ChannelClosed("the peer closed the control channel") from error

    def send_fd(self, fd: int) -> None:
        """Send one descriptor; the receiver gets its own duplicate."""
        with socket.socket(fileno=os.dup(self._conn.fileno())) as sock:
            try:
                socket.send_fds(sock, [b"F"], [fd])
            except (BrokenPipeError, ConnectionResetError) as error:
                raise ChannelClosed("the peer closed the control channel") from error

    def recv_fd(self) -> int:
        """Receive one descriptor sent with :meth:`send_fd`. The caller owns it."""
        with socket.socket(fileno=os.dup(self._conn.fileno())) as sock:
            data, fds, _flags, _addr = socket.recv_fds(sock, 1, 1)
        if not data:
            raise ChannelClosed("the peer closed the control channel before sending an fd")
        if len(fds) != 1 or data != b"F":
            for fd in fds:
                os.close(fd)
            raise OSError("torn control channel: expected exactly one file descriptor")
        return fds[0]

    def close(self) -> None:
        """Close this end. Idempotent."""
        if not self._conn.closed:
            self._conn.close()
