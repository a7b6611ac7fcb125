"""The trainer's side of its worker server: starting it, and asking it for workers. Runs in the
trainer.

A worker server (:mod:`workers.server`) is one process per trainer process with DALI imported
(never run) and the trainer's main module imported once; every ``start_method="forkserver"``
worker (the default) is forked from it, so a loader starts without importing DALI or the script
again. It is the project's own, end to end, over public APIs: ``os.fork`` or ``os.posix_spawn``,
a ``SOCK_SEQPACKET`` socketpair, ``socket.send_fds``; nothing of ``multiprocessing``'s
forkserver. The requests and replies are :mod:`ipc.server_wire`.

How it starts:

``fork``
    Forked from the trainer, when that is safe (:func:`fork_refusal`): no other Python thread,
    no DALI operator ever run (DALI's threads would be missing in the copy), no CUDA driver
    loaded, no native thread started since the loader was imported (an OpenMP pool a forked
    child could not use). The server then has everything the trainer imported (torch, DALI, the
    script's imports) without importing it again; it drops the inherited descriptors and imports
    the main module as ``__mp_main__`` (cheap: its imports are there).
``exec``
    Otherwise a fresh interpreter, which imports DALI and then the main module as
    ``__mp_main__``, as a spawned worker would (once, instead of once per worker).

``DALI_LOADER_SERVER=fork`` or ``exec`` forces one way (``fork`` fails when it is not safe).

When it starts: at the first loader that needs it (inside a test session: a fresh interpreter,
since a fork would carry that test's state into later tests), or earlier: the pytest plugin starts
it at a session's start, and :func:`start_early` at the end of the loader package's import
(``DALI_LOADER_EARLY_SERVER=0`` turns that off), so the server imports DALI and parses what
DALI's capture parses while the script goes on with its own imports and set-up. It lives until
the trainer exits (it ends at end of stream on its socket, after the workers it forked), or
until :func:`shutdown`; every later loader uses it.
It shows as ``dali-loader-server (trainer PID)`` in ``ps``, its workers as
``dali-loader-worker-K (trainer PID)``.

Each worker is a :class:`loader.processes._server_worker.ServerWorker` (which imports this module,
never the other way), which the pool uses as it uses a ``multiprocessing`` process.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import inspect
import logging
import multiprocessing
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from multiprocessing import spawn

import psutil

from ipc import server_wire as sw
from ipc.signals import blocked_for_start
from workers import server as worker_server

from ..config import main_file

logger = logging.getLogger("loader")

#: The environment variable that chooses how the server starts: ``fork``, ``exec`` (or unset).
SERVER_ENV = "DALI_LOADER_SERVER"
#: ``0`` keeps ``import loader`` from starting the worker server (:func:`start_early`).
EARLY_ENV = "DALI_LOADER_EARLY_SERVER"
#: Modules run with ``python -m`` that never start a loader: no server at their import.
_NO_LOADER_MAINS = ("loader.tars",)
#: Seconds a worker's request may wait for the server's answer (its pid): the server answers
#: requests in order, and a Prepare may import the main module first.
REPLY_TIMEOUT = 300.0

_lock = threading.Lock()
_running: WorkerServer | None = None
#: Servers told to stop while their workers ran: reaped once they exit.
_retired: list[WorkerServer] = []


def _native_threads() -> int:
    """Threads of this process that Python did not start (OpenBLAS, OpenMP, DALI, CUDA)."""
    try:
        return len(os.listdir("/proc/self/task")) - threading.active_count()
    except OSError:
        return 0


#: Native threads when the loader was imported: a pool started later (OpenMP after a torch
#: operator) makes a fork of the trainer unsafe.
_NATIVE_AT_IMPORT = _native_threads()


def supported() -> bool:
    """True where the worker server can run (Linux: ``fork``, ``posix_spawn``, ``send_fds``)."""
    return all(hasattr(os, name) for name in ("fork", "posix_spawn")) and hasattr(
        socket, "send_fds"
    )


def fork_refusal() -> str | None:
    """Why the server may not be forked from this process now, or None when it may."""
    if threading.active_count() > 1:
        return "other Python threads run in this process"
    try:
        names = []
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/comm", encoding="utf-8", errors="replace") as f:
                names.append(f.read().strip())
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            cuda = any("libcuda.so" in line for line in maps)
    except OSError:
        return "/proc/self cannot be read"
    if any(name.startswith("[DALI]") for name in names):
        return "DALI has run operators in this process (its threads would be missing)"
    if cuda:
        return "a CUDA driver is loaded in this process"
    if len(names) - threading.active_count() > _NATIVE_AT_IMPORT:
        return "native threads started since the loader was imported (an OpenMP pool?)"
    return None


def server_pid() -> int | None:
    """The pid of this process's running worker server, or None (public as
    ``loader.worker_server_pid``)."""
    server = _running
    return server.pid if server is not None and server.alive() else None


def shutdown(timeout: float = 10.0) -> int | None:
    """Stop this process's worker server (public as ``loader.shutdown_worker_server``): it
    stops serving at once and exits when the workers it forked have exited, so loaders still
    open keep theirs. Waits up to ``timeout`` seconds for a server with no workers left (then
    kills it). Returns the stopped server's pid, or None when none ran; safe to call again, and
    the next loader that needs a server starts a new one."""
    global _running
    with _lock:
        server, _running = _running, None
        _reap_retired()
    if server is None:
        return None
    server.forget()
    if not server.alive():
        return server.pid
    try:
        busy = bool(psutil.Process(server.pid).children())
    except psutil.Error:
        busy = False
    if busy:  # it exits after its workers; reaped by a later call or at exit
        _retired.append(server)
        logger.debug("worker server %d stops after its running workers", server.pid)
    elif not server.wait(timeout):
        logger.warning(
            "the worker server (pid %d) did not exit within %g s; killed", server.pid, timeout
        )
        server.kill()
    return server.pid


def _reap_retired() -> None:
    _retired[:] = [server for server in _retired if server.alive()]


def server_fds() -> set[int]:
    """The descriptors this process keeps open for its server (to tell them from leaks)."""
    server = _running
    if server is None:
        return set()
    return {fd for fd in (server.fileno(), server.release_fd()) if fd >= 0}


def wait_released(timeout: float = 5.0) -> bool:
    """Wait up to ``timeout`` seconds until this process's server no longer holds copies of the
    descriptors this process had when it was forked (:meth:`WorkerServer.wait_released`); True
    at once when none runs or it is a fresh interpreter."""
    server = _running
    return server is None or server.wait_released(timeout)


def started_how() -> str | None:
    """``fork`` or ``exec``: how the running server was started; None when none runs."""
    server = _running
    return server.how if server is not None and server.alive() else None


def ensure_running(files: Sequence[str] = ()) -> str:
    """Start this process's worker server unless one runs; returns how the running one was
    started (``fork`` or ``exec``). ``files`` are parsed for DALI's capture in the server
    before it forks a worker (those of the suite's or first loader's ``source`` and ``step``)."""
    return running(files).how


def running(files: Sequence[str] = (), *, by_loader: bool = False) -> WorkerServer:
    """This process's worker server, started if none runs (:func:`ensure_running`).
    ``by_loader``: a loader needs it now; in a test session that means inside a test, whose
    state (its monkeypatches) a fork would carry into every later test's workers, so the
    server is then a fresh interpreter (the pytest plugin starts it before the first test)."""
    global _running
    with _lock:
        _reap_retired()
        server = _running
        if server is None or not server.alive():
            if server is not None:
                server.forget()
            in_test = by_loader and "_pytest" in sys.modules
            _running = server = WorkerServer.start(_choose(in_test))
            logger.debug("worker server started (%s), pid %d", server.how, server.pid)
        if files:
            server.prepare((), files)
        return server


def start_early() -> str | None:
    """Start the worker server now, in the background, if this process is a trainer that will
    use it: the default start method is the server's, this is no ``multiprocessing`` child or
    worker server, no test session (the plugin starts it there), and a fork is safe now (an
    ``exec`` server waits for the first loader). Meant for the end of the loader package's
    import, when a script has not yet started threads or CUDA. Returns how it started, or None."""
    from ..config import START_METHOD_ENV, default_start_method

    method = default_start_method() or os.environ.get(START_METHOD_ENV, "") or "forkserver"
    argv = list(getattr(sys, "orig_argv", ()))
    run_module = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else ""
    if (
        os.environ.get(EARLY_ENV, "1") == "0"
        or run_module in _NO_LOADER_MAINS
        or "--multiprocessing-fork" in argv  # (a spawned child, whose parent_process() is not
        # set yet while it imports: a loader's spawned worker, a pool's process)
        or method != "forkserver"
        or not supported()
        or worker_server.serving()
        or multiprocessing.parent_process() is not None
        or "_pytest" in sys.modules
        or os.environ.get(SERVER_ENV, "") not in ("", "fork")
        or fork_refusal() is not None
    ):
        return None
    return ensure_running()


def _choose(in_test: bool = False) -> str:
    wanted = os.environ.get(SERVER_ENV, "")
    if wanted not in ("", "fork", "exec"):
        raise ValueError(f"{SERVER_ENV} must be 'fork' or 'exec' (or unset), got {wanted!r}")
    if wanted == "exec":
        return "exec"
    refusal = "a test is running (its state would reach later tests)" if in_test else None
    refusal = refusal or fork_refusal()
    if refusal is None:
        return "fork"
    if wanted == "fork":
        raise RuntimeError(
            f"{SERVER_ENV}=fork, but the worker server cannot be forked from this process: "
            f"{refusal}. Unset {SERVER_ENV} to start a fresh one instead"
        )
    logger.debug("worker server: a fresh interpreter (%s)", refusal)
    return "exec"


def _setup() -> sw.Setup:
    """The trainer's main module and interpreter state (as ``multiprocessing.spawn`` finds
    them for a spawned child)."""
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None)
    return sw.Setup(
        main_path=main_file(),  # (None for a script read from stdin: "<stdin>" is no file)
        main_name=name if isinstance(name, str) else None,
        sys_path=tuple(sys.path),
        argv=tuple(sys.argv),
        cwd=os.getcwd(),
    )


def _executing_modules() -> list[str]:
    """The modules whose code is running on this thread's stack (an import in progress)."""
    names = []
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == "<module>":
            name = frame.f_globals.get("__name__")
            if isinstance(name, str):
                names.append(name)
        frame = frame.f_back
    return names


class WorkerServer:
    """The trainer's handle on its running server: its pid, how it started, the socket to it."""

    def __init__(self, pid: int, how: str, sock: socket.socket, release: int | None = None) -> None:
        self.pid = pid
        self.how = how
        self._sock = sock
        self._send_lock = threading.Lock()
        self._exited = False
        #: a forked server's release pipe: its end of stream tells that the server holds
        #: none of this process's descriptors any more (None: told, or no fork)
        self._release = release
        self._release_lock = threading.Lock()
        #: False once forgotten (``shutdown_worker_server``): it forks no more workers
        self.serving = True

    @classmethod
    def start(cls, how: str) -> WorkerServer:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # A fork holds copies of every descriptor of this process until it has released them
        # (workers.server._release_inherited), the write end of this pipe among them: the
        # read end's end of stream tells when (wait_released).
        release = os.pipe() if how == "fork" else None
        try:
            with blocked_for_start():  # a Ctrl-C while it starts is the trainer's (ipc.signals)
                pid = _fork_server(ours, theirs) if how == "fork" else _exec_server(theirs)
        except BaseException:
            ours.close()
            if release is not None:
                os.close(release[0])
            raise
        finally:
            theirs.close()
            if release is not None:
                os.close(release[1])
        server = cls(pid, how, ours, release[0] if release is not None else None)
        server.send(_setup())
        return server

    def fileno(self) -> int:
        """The socket's descriptor (-1 once closed)."""
        return self._sock.fileno()

    def release_fd(self) -> int:
        """The release pipe's read end (-1 once closed, or for no fork)."""
        release = self._release
        return release if release is not None else -1

    def wait_released(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a forked server to release the descriptors it
        inherited (until then a pipe this process closes stays open there, and a leak check
        that counts what the server holds as the server's could miss it, or later find it).
        True once it has (or has exited), or when it is no fork."""
        with self._release_lock:
            if self._release is None:
                return True
            poll = select.poll()
            poll.register(self._release, select.POLLIN)
            told = bool(poll.poll(max(0, int(timeout * 1000))))  # (end of stream: never data)
            # (not told: a process forked from this one in the moment the pipe's write end was
            # open here holds it; not waited for again)
            os.close(self._release)
            self._release = None
            return told

    def alive(self) -> bool:
        """False once the server has exited (and is reaped: it is this process's child)."""
        if not self._exited:
            try:
                self._exited = os.waitpid(self.pid, os.WNOHANG)[0] != 0
            except ChildProcessError:
                self._exited = True
        return not self._exited

    def forget(self) -> None:
        """Close the socket: a server that still runs stops serving (module docstring)."""
        self.serving = False
        self._sock.close()
        with self._release_lock:
            if self._release is not None:
                os.close(self._release)
                self._release = None

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the server to exit; True once it has."""
        deadline = time.monotonic() + timeout
        while self.alive():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        self.wait(5.0)

    def send(self, request: sw.Request, fds: list[int] | None = None) -> None:
        with self._send_lock:
            sw.send_request(self._sock, request, fds)

    def prepare(
        self, modules: Sequence[str], files: Sequence[str], needs: Sequence[str] = ()
    ) -> None:
        """Ask the server to import ``modules``, parse ``files`` and import what a dataset
        definition will open (``needs``: ``Definition.server_needs``) before the next fork."""
        self.send(sw.Prepare(tuple(modules), tuple(files), tuple(needs)))


def _fork_server(ours: socket.socket, theirs: socket.socket) -> int:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    pid = os.fork()
    if pid:
        return pid
    try:  # the child: becomes the server and never returns into the trainer's code
        ours.close()
        worker_server.serve_forked(theirs, _executing_modules())
    except BaseException:
        with contextlib.suppress(Exception):
            traceback.print_exc()
    finally:
        os._exit(1)


def _exec_server(theirs: socket.socket) -> int:
    root = os.path.dirname(os.path.dirname(os.path.abspath(worker_server.__file__)))
    command = (
        f"import sys; sys.path.insert(0, {root!r}); "
        "from workers.server import serve_fresh; serve_fresh(3)"
    )
    executable = spawn.get_executable() or sys.executable
    # a copy numbered above 3, so that the child's dup2 onto 3 always clears close-on-exec
    fd = fcntl.fcntl(theirs.fileno(), fcntl.F_DUPFD_CLOEXEC, 10)
    try:
        return os.posix_spawn(
            executable,
            [executable, "-c", command],
            dict(os.environ),
            file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                (os.POSIX_SPAWN_DUP2, fd, 3),
            ],
        )
    finally:
        os.close(fd)


def _forget_in_child() -> None:
    """In any child forked from this process (a worker server among them): the trainer's
    server is not the child's, and the lock may have been held by another thread."""
    global _lock, _running
    _lock = threading.Lock()
    server, _running = _running, None
    if server is not None:
        server.forget()


os.register_at_fork(after_in_child=_forget_in_child)


@atexit.register
def _close_at_exit() -> None:
    """At the trainer's exit: close the socket, and the server ends (registered at import, so
    it runs after the handlers of what came later, loaders' among them)."""
    server = _running
    if server is not None:
        server.forget()
    _reap_retired()
