"""The worker server's contract: what a trainer asks its worker server, and what the server and a
forked worker read. Both sides import this module: ``loader/_server.py`` (the trainer, the one
client) and ``workers/server.py`` (the server and the workers it forks).

Trainer -> server, over one ``AF_UNIX`` ``SOCK_SEQPACKET`` socketpair (one packet per request: a
pickled record, descriptors as ``SCM_RIGHTS``):

* :class:`Setup` -- first and once: the trainer's main module, and the interpreter state a fresh
  server takes over (a server forked from the trainer has it already).
* :class:`Prepare` -- before a loader's first worker: import the main module as ``__mp_main__``
  (once per server), the modules of the loader's functions, and parse the files DALI's capture
  analyses, so that every worker forked afterwards finds them done.
* :class:`Fork` -- fork one worker. Its descriptors, in order: the worker's status socket, the read
  end of its start pipe, then the worker's own (control channel, stack pipe, liveness pipe).

Server -> trainer, per worker, on its status socket: two signed 64-bit integers, the worker's pid
once forked and its exit code once reaped (negative: the signal that killed it). End of stream
before the exit code means the server is gone.

Trainer -> worker, on the start pipe: one pickled :class:`WorkerStart`, then end of stream.

The socketpair and the pipes are created by the trainer for its own server, so the only bytes
ever unpickled come from that trainer.
"""

from __future__ import annotations

import os
import pickle
import socket
import struct
from dataclasses import dataclass
from typing import Any

#: Bytes one request may take (a packet larger than this is refused before it is sent).
MAX_REQUEST = 1 << 16
#: Descriptors one request may carry.
MAX_FDS = 8
#: The status socket's integers: a pid, then an exit code.
STATUS = struct.Struct("<q")
#: What a worker's status reads as when the server went away before reporting its exit.
SERVER_GONE = 255


@dataclass(frozen=True, slots=True)
class Setup:
    """Where the trainer's main module is (``main_name`` when it ran with ``-m``, else
    ``main_path``; neither for ``-c``, a REPL or a notebook) and its interpreter state."""

    main_path: str | None
    main_name: str | None
    sys_path: tuple[str, ...]
    argv: tuple[str, ...]
    cwd: str


@dataclass(frozen=True, slots=True)
class Prepare:
    """Modules to import and files to parse before forking a loader's workers; ``needs``: what
    the loader's dataset definition will open (``"protocol:s3"``, ``"module:pyarrow.parquet"``:
    ``Definition.server_needs``), imported before the fork where the server has not yet."""

    modules: tuple[str, ...]
    files: tuple[str, ...]
    needs: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Fork:
    """Fork one worker; its descriptors travel with the request (module docstring)."""

    name: str


Request = Setup | Prepare | Fork


@dataclass(frozen=True, slots=True)
class WorkerStart:
    """What a forked worker takes from the trainer at the moment it starts, as a spawned one
    would: the environment, working directory and import path; ``spec`` is pickled separately
    (unpickling it imports the user's modules, which needs the path first)."""

    environ: dict[str, str]
    cwd: str
    sys_path: tuple[str, ...]
    spec: bytes


def send_request(sock: socket.socket, request: Request, fds: list[int] | None = None) -> None:
    """Send one request (and its descriptors) as one packet."""
    data = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) > MAX_REQUEST:
        raise ValueError(f"worker server request of {len(data)} bytes (at most {MAX_REQUEST})")
    if len(fds or ()) > MAX_FDS:
        raise ValueError(f"worker server request with {len(fds or ())} descriptors")
    socket.send_fds(sock, [data], fds or [])


def receive_request(sock: socket.socket) -> tuple[Request, list[int]] | None:
    """The next request and its descriptors; None at end of stream (the trainer is gone)."""
    data, fds, flags, _address = socket.recv_fds(sock, MAX_REQUEST, MAX_FDS)
    if not data:
        for fd in fds:
            os.close(fd)
        return None
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        for fd in fds:
            os.close(fd)
        raise ValueError("a worker server request was truncated")
    request: Any = pickle.loads(data)
    if not isinstance(request, (Setup, Prepare, Fork)):
        raise TypeError(f"not a worker server request: {type(request).__name__}")
    return request, fds


def send_status(sock: socket.socket, value: int) -> None:
    """Send one integer of a worker's status (its pid, then its exit code)."""
    sock.sendall(STATUS.pack(value))


def read_all(fd: int) -> bytes:
    """Every byte up to end of stream (a worker's start pipe)."""
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)
