"""The worker server: one process per trainer process that holds DALI and the main module,
imported once, and forks every ``start_method="forkserver"`` worker. Runs in the trainer.

It is multiprocessing's forkserver (its serving loop, its protocol and its client side), started
by this module instead of by multiprocessing, in one of two ways:

``fork``
    Forked from the trainer at its first forkserver loader: the server has everything the
    trainer imported (torch, numpy, the main module, its ``source`` and ``step``) without
    importing any of it again, imports DALI (never runs it) and serves. Chosen only when that is
    safe: DALI was never imported in the trainer (a process forked after DALI ran hangs on its
    first operator), no CUDA driver is loaded in it (a forked child cannot use CUDA), and no
    other Python thread runs (a lock one holds would stay locked in the server). The server
    releases every descriptor it inherited (each becomes ``/dev/null``, so the number stays
    taken) and freezes the inherited objects for the garbage collector, so that workers share
    the trainer's pages instead of copying them.
``exec``
    Otherwise, a fresh interpreter that imports DALI and the main module once, the latter under
    the name ``__mp_main__`` as a spawned worker does (code under
    ``if __name__ == "__main__":`` does not run). Python 3.11's own forkserver never preloads
    the main module (it passes ``main_path`` to the server, while ``get_preparation_data`` names
    it ``init_main_from_path``), so every worker forked by it imported the script again, and
    torch with it.

A forked worker finds ``__main__`` already imported (same file) and does not import it again.
The server lives until the trainer and every worker have exited; every later loader of the
process uses it. ``DALI_LOADER_SERVER=exec`` (or ``fork``) chooses the way; unset, ``fork``
when safe.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from multiprocessing import connection as _connection
from multiprocessing import forkserver as _forkserver
from multiprocessing import process, resource_tracker, spawn
from multiprocessing import util as _util
from typing import Any

logger = logging.getLogger("loader")

#: The environment variable that chooses how the server starts: ``fork``, ``exec`` (or unset).
SERVER_ENV = "DALI_LOADER_SERVER"

#: The preparation data a fresh (``exec``) server takes from the trainer.
_PREPARATION_KEYS = ("sys_path", "sys_argv", "dir", "init_main_from_path", "init_main_from_name")

# multiprocessing's private parts this module uses (typeshed leaves them out)
forkserver: Any = _forkserver
connection: Any = _connection
util: Any = _util

_lock = threading.Lock()
_how: str | None = None  # how the running server was started


def supported() -> bool:
    """True where multiprocessing's forkserver has the shape this module relies on (its
    serving loop takes no authentication key: Python 3.10 to 3.13)."""
    server = getattr(forkserver, "_forkserver", None)
    return (
        sys.version_info < (3, 14)
        and server is not None
        and all(
            hasattr(server, name)
            for name in ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid")
        )
    )


def fork_refusal() -> str | None:
    """Why the server may not be forked from this process now, or None when it may."""
    if any(name == "nvidia.dali" or name.startswith("nvidia.dali.") for name in sys.modules):
        return "DALI was imported in this process"
    if threading.active_count() > 1:
        return "other threads run in this process"
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            if any("libcuda.so" in line for line in maps):
                return "a CUDA driver is loaded in this process"
    except OSError:
        return "/proc/self/maps cannot be read"
    return None


def server_pid() -> int | None:
    """The pid of this process's running worker server, or None."""
    server = forkserver._forkserver
    pid = server._forkserver_pid
    if pid is None:
        return None
    with contextlib.suppress(ChildProcessError):
        if os.waitpid(pid, os.WNOHANG)[0] == 0:
            return int(pid)
    return None


def server_fds() -> set[int]:
    """The descriptors this process keeps open for its server (to tell them from leaks)."""
    fd = forkserver._forkserver._forkserver_alive_fd
    return {fd} if isinstance(fd, int) else set()


def started_how() -> str | None:
    """``fork`` or ``exec`` when this module started the running server, else None."""
    return _how if server_pid() is not None else None


def ensure_running(files: Sequence[str] = ()) -> str:
    """Start the worker server unless one runs; returns how the running one was started
    (``fork``, ``exec``, or ``multiprocessing`` when multiprocessing started it). A new server
    parses ``files`` (those of the first loader's ``source`` and ``step``), the main module and
    DALI's own traced files for DALI's capture before it forks any worker
    (:func:`workers._imports.warm_source_analysis`)."""
    global _how
    server = forkserver._forkserver
    with _lock, server._lock:
        if server._forkserver_pid is not None:
            pid, _status = os.waitpid(server._forkserver_pid, os.WNOHANG)
            if not pid:
                return _how or "multiprocessing"
            os.close(server._forkserver_alive_fd)
            server._forkserver_address = None
            server._forkserver_alive_fd = None
            server._forkserver_pid = None
        resource_tracker.ensure_running()
        how = _choose()
        with socket.socket(socket.AF_UNIX) as listener:
            address = connection.arbitrary_address("AF_UNIX")
            listener.bind(address)
            if not util.is_abstract_socket_namespace(address):
                os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()
            try:
                if how == "fork":
                    pid = _fork_server(listener.fileno(), alive_r, alive_w, list(files))
                else:
                    pid = _exec_server(listener.fileno(), alive_r, list(files))
            except BaseException:
                os.close(alive_w)
                raise
            finally:
                os.close(alive_r)
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid
        _how = how
        logger.debug("worker server started (%s), pid %d", how, pid)
        return how


def _choose() -> str:
    wanted = os.environ.get(SERVER_ENV, "")
    if wanted not in ("", "fork", "exec"):
        raise ValueError(f"{SERVER_ENV} must be 'fork' or 'exec' (or unset), got {wanted!r}")
    if wanted == "exec":
        return "exec"
    refusal = fork_refusal()
    if refusal is None:
        return "fork"
    if wanted == "fork":
        raise RuntimeError(
            f"{SERVER_ENV}=fork, but the worker server cannot be forked from this process: "
            f"{refusal}. Unset {SERVER_ENV} to start a fresh one instead"
        )
    logger.debug("worker server: a fresh interpreter (%s)", refusal)
    return "exec"


def _exec_server(listener_fd: int, alive_r: int, files: list[str]) -> int:
    data = spawn.get_preparation_data("dali-loader-forkserver")
    preparation = {key: value for key, value in data.items() if key in _PREPARATION_KEYS}
    command = (
        "from loader._server import serve_forkserver; "
        f"serve_forkserver({listener_fd}, {alive_r}, {preparation!r}, {files!r})"
    )
    executable = spawn.get_executable()
    arguments = [executable, *util._args_from_interpreter_flags(), "-c", command]
    return int(util.spawnv_passfds(executable, arguments, [listener_fd, alive_r]))


def serve_forkserver(
    listener_fd: int, alive_r: int, preparation: dict[str, Any], files: list[str]
) -> None:
    """A fresh server's entry point: import the main module (as ``__mp_main__``, the way a
    spawned worker does) and DALI, then serve. A main module that fails to import is left to
    each worker, whose own import of it then fails and is reported by the trainer."""
    current = process.current_process()
    current._inheriting = True  # type: ignore[attr-defined]
    try:
        spawn.prepare(preparation)
    except BaseException:  # the workers report it (module docstring)
        logger.debug("worker server: the main module did not import", exc_info=True)
    finally:
        del current._inheriting  # type: ignore[attr-defined]
    _import_dali(files)
    forkserver.main(listener_fd, alive_r, [])


def _fork_server(listener_fd: int, alive_r: int, alive_w: int, files: list[str]) -> int:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        # the trainer held these while forking: a worker starting a forkserver of its own must
        # find them free
        global _lock
        _lock = threading.Lock()
        forkserver._forkserver._lock = threading.Lock()
        os.close(alive_w)
        _release_inherited(keep={0, 1, 2, listener_fd, alive_r})
        _import_dali(files)
        gc.freeze()
        forkserver.main(listener_fd, alive_r, [])
        code = 0
    except SystemExit as stop:  # the serving loop's end: every client is gone
        code = stop.code if isinstance(stop.code, int) else 0
    except BaseException:  # never return into the trainer's code
        with contextlib.suppress(Exception):
            import traceback

            traceback.print_exc()
    finally:
        os._exit(code)
    raise AssertionError("unreachable")  # pragma: no cover


def _release_inherited(keep: set[int]) -> None:
    """Point every inherited descriptor but ``keep`` at /dev/null: the files, pipes and sockets
    of the trainer are released, and the numbers stay taken (a trainer object that closes one
    later closes /dev/null, not a descriptor of the server's own)."""
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            if fd in keep or fd == null:
                continue
            with contextlib.suppress(OSError):
                os.fstat(fd)  # not the listing's own descriptor, closed by now
                os.dup2(null, fd)
    finally:
        os.close(null)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _import_dali(files: list[str]) -> None:
    from workers import prepare_worker_server

    prepare_worker_server(files)


def files_of(*functions: Any) -> list[str]:
    """The source files of the modules that define ``functions`` (partials unwrapped)."""
    files = []
    for function in functions:
        while isinstance(function, functools.partial):
            function = function.func
        module = sys.modules.get(getattr(function, "__module__", None) or "")
        path = getattr(module, "__file__", None)
        if isinstance(path, str):
            files.append(path)
    return files
