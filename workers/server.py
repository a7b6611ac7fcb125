"""The worker server's process: DALI imported (never run), the trainer's main module imported once
as ``__mp_main__``, and a loop that forks one worker per request. Runs in the server process;
each child it forks becomes one worker (:func:`_start_forked_worker`, then the worker's one entry
point, :func:`workers.process.run_worker`).

::

    trainer (loader/_server.py)                        server (this module, one thread)
    Setup, Prepare, Fork + descriptors  ══ SEQPACKET ══►  serve(): one request at a time
    status socket, one per worker       ◄──────────────  pid once forked; exit code once reaped
    start pipe, one per worker          ─────────────────►  forked child: WorkerStart, then
                                                            run_worker (workers/process/_entry.py)

The server reads every request from its one client, the trainer that started it; it writes only
to the status sockets. It never runs a DALI operator and has one thread, so a fork of it is a clean
copy: DALI imported, the main module and the loaders' modules imported, DALI's source analysis of
their files cached (:mod:`workers.process`), nothing running. Its children share those pages
(``gc.freeze()`` keeps the garbage collector from writing to them).

It stops serving at the end of stream on its socket (the trainer exited, or called
``loader.shutdown_worker_server()``) and exits once the workers it forked have exited (those
of a trainer that is gone exit on their own liveness pipes, and are waited for at most
:data:`ORPHANED_WAIT` seconds). Its title is ``dali-loader-server`` (:mod:`workers.process._title`).
Those still there then (a worker stuck before it watches that pipe: in a main module's
top-level work) are killed. A worker forked from a server whose import of the main module failed
writes that import's traceback to its stderr and exits with 1, as a spawned worker whose import
fails does, so its error reaches the trainer the same way (it does not run the script again).

Everything here goes through public APIs (``os.fork``, ``socket.recv_fds``, ``signal``,
``runpy``), none of ``multiprocessing``'s internals.
"""

from __future__ import annotations

import ast
import contextlib
import gc
import importlib.util
import logging
import os
import pickle
import runpy
import select
import selectors
import signal
import socket
import sys
import time
import traceback
import types
from collections.abc import Iterable, Iterator
from multiprocessing.connection import Connection
from typing import NoReturn

from ipc import limits
from ipc import server_wire as sw
from ipc.signals import leave_to_trainer

from . import startup
from .process import server_title, set_title

logger = logging.getLogger("loader")

_serving = False

#: Seconds a server whose trainer is gone waits for that trainer's workers to exit.
ORPHANED_WAIT = 30.0


def serving() -> bool:
    """True in a worker server and in the workers it forked (no server is started from them)."""
    return _serving


def serve_forked(sock: socket.socket, partial_modules: Iterable[str]) -> NoReturn:
    """The entry point of a server forked from the trainer, in the child of that fork: release
    what the trainer's copy holds, drop the modules that were still executing at the fork (their
    code never finishes here; they are imported again when needed), then serve. Never returns."""
    # (the write end of the trainer's release pipe is among them: the trainer sees it end)
    _release_inherited(keep={0, 1, 2, sock.fileno()})
    for name in partial_modules:
        if name != "__main__":
            sys.modules.pop(name, None)
    _run(sock, fresh=False)


def serve_fresh(fd: int) -> NoReturn:
    """The entry point of a fresh server (a new interpreter): serve on descriptor ``fd``."""
    _run(socket.socket(fileno=fd), fresh=True)


def _run(sock: socket.socket, *, fresh: bool) -> NoReturn:
    global _serving
    _serving = True
    code = 0
    trainer = os.getppid()
    try:
        _reset_signals()
        limits.raise_oom_score(limits.SERVER_OOM_SCORE_ADJ)
        set_title(server_title(trainer))
        first = sw.receive_request(sock)
        if first is None:
            _exit(0)
        setup, fds = first
        for fd in fds:
            os.close(fd)
        if not isinstance(setup, sw.Setup):
            raise TypeError(f"the first request must be Setup, got {type(setup).__name__}")
        if fresh:
            sys.path[:] = setup.sys_path
            sys.argv[:] = setup.argv
            os.chdir(setup.cwd)
        server = Server(sock, setup)
        server.warm()
        server.serve()
    except BaseException:  # never return into the caller's code (a fork of the trainer)
        code = 1
        if os.getppid() != trainer:  # (a trainer gone while this one warmed: a script that
            _exit(code)  # imported the loader and ended; its environment may be changing)
        with contextlib.suppress(Exception):
            traceback.print_exc()
    _exit(code)


def _exit(code: int) -> NoReturn:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _reset_signals() -> None:
    """No handler of the trainer's runs here: every Python-level handler goes back to the
    default, and the signals a cluster or a terminal sends to the whole job are ignored
    (:mod:`ipc.signals`: the trainer's to handle; the server ends with the trainer). The
    workers it forks start with the same."""
    for signum in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError):
            if callable(signal.getsignal(signum)):
                signal.signal(signum, signal.SIG_DFL)
    leave_to_trainer()


def _release_inherited(keep: set[int]) -> None:
    """Point every inherited descriptor but ``keep`` at /dev/null: the trainer's files, pipes and
    sockets are released (a worker's end of stream is not held open by the server), and the
    numbers stay taken (a trainer object that closes one later closes /dev/null)."""
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


def import_main(setup: sw.Setup) -> bool:
    """Import the trainer's main module under the name ``__mp_main__``, as a spawned worker
    does (code under ``if __name__ == "__main__":`` does not run), and make it ``__main__``
    here. False when there is none to import (``-c``, a REPL, a package's ``__main__``)."""
    name, path = setup.main_name, setup.main_path
    if name is not None and name != "__main__" and not name.endswith(".__main__"):
        content = runpy.run_module(name, run_name="__mp_main__", alter_sys=True)
    elif name is None and path is not None and os.path.basename(path) != "ipython":
        content = runpy.run_path(path, run_name="__mp_main__")
    else:
        return False
    module = types.ModuleType("__mp_main__")
    module.__dict__.update(content)
    _old_mains.append(sys.modules.get("__main__"))
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module
    return True


def main_file(setup: sw.Setup) -> str | None:
    """The file of the trainer's main module (its path, or the module's given with ``-m``);
    None when it has none."""
    if setup.main_name is not None:
        try:
            spec = importlib.util.find_spec(setup.main_name)
        except (ImportError, ValueError):
            return None
        return None if spec is None else spec.origin
    return setup.main_path


#: What a main module's top level may hold to be imported before a loader is made: imports,
#: definitions, assignments (constants, ``functools.partial``), a docstring, ``pass``.
_DEFINING = (
    ast.Import,
    ast.ImportFrom,
    ast.FunctionDef,
    ast.AsyncFunctionDef,
    ast.ClassDef,
    ast.Assign,
    ast.AnnAssign,
    ast.Pass,
)


def only_defines(path: str | None) -> bool:
    """Whether the Python file at ``path`` has a ``if __name__ == "__main__":`` guard and, outside
    it, only defines (:data:`_DEFINING`; ``if``/``try`` blocks of the same, a docstring): then
    importing it runs no work of the script's, and the server may import it before the trainer
    makes a loader. False for anything else, or a file that cannot be read or parsed."""
    if not path or not path.endswith(".py"):
        return False
    try:
        with open(path, "rb") as file:
            tree = ast.parse(file.read(), path)
    except (OSError, SyntaxError, ValueError):
        return False
    guarded = False

    def defines(body: list[ast.stmt]) -> bool:
        nonlocal guarded
        for number, statement in enumerate(body):
            if isinstance(statement, ast.If) and _is_main_guard(statement.test):
                guarded = True
                if not defines(statement.orelse):
                    return False
            elif isinstance(statement, ast.If):
                if not (defines(statement.body) and defines(statement.orelse)):
                    return False
            elif isinstance(statement, ast.Try):
                blocks = [statement.body, statement.orelse, statement.finalbody]
                blocks += [handler.body for handler in statement.handlers]
                if not all(defines(block) for block in blocks):
                    return False
            elif isinstance(statement, ast.Expr) and number == 0:
                if not isinstance(statement.value, ast.Constant):  # (a docstring only)
                    return False
            elif not isinstance(statement, _DEFINING):
                return False
        return True

    return defines(tree.body) and guarded


def _is_main_guard(test: ast.expr) -> bool:
    """``__name__ == "__main__"`` (either way round)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return False
    if not isinstance(test.ops[0], ast.Eq):
        return False
    sides = [test.left, test.comparators[0]]
    names = [side for side in sides if isinstance(side, ast.Name) and side.id == "__name__"]
    texts = [side for side in sides if isinstance(side, ast.Constant) and side.value == "__main__"]
    return len(names) == 1 and len(texts) == 1


#: What :func:`one_math_thread` sets in the server's environment: OpenMP's and the BLAS
#: libraries' thread counts, read once, when the library first loads.
ONE_THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def one_math_thread() -> None:
    """Before the server runs the script's own code (its main module's top level, the imports
    of its loaders' modules): torch's and OpenMP's math on one thread in this process. A matrix
    product on more threads starts an OpenMP pool in the thread that runs it, and a fork of
    that thread keeps the pool's state without its threads: a worker forked afterwards whose
    main thread ran such a product (a source that builds a model) waited for those threads for
    ever. On one thread no pool starts. The forked workers inherit it (as torch's own
    ``DataLoader`` workers, which set ``torch.set_num_threads(1)``); a worker's code may set
    more, which starts a pool of its own. The workers get the trainer's environment back."""
    for name in ONE_THREAD_VARIABLES:
        os.environ[name] = "1"
    torch = sys.modules.get("torch")
    if torch is not None:  # (loaded already: it read the environment then)
        with contextlib.suppress(Exception):
            torch.set_num_threads(1)


#: The main modules replaced by ``__mp_main__`` (kept alive: their functions' globals).
_old_mains: list[types.ModuleType | None] = []


class Server:
    """The serving loop of one server: requests in order, a fork per worker, and each worker's
    exit code to its status socket once reaped (module docstring)."""

    def __init__(self, sock: socket.socket, setup: sw.Setup) -> None:
        self._sock = sock
        self._setup = setup
        self._statuses: dict[int, socket.socket] = {}  # pid -> status socket, until reaped
        self._main_state = "pending"  # "imported", "failed" or "none" once warm
        self._main_error = ""  # the traceback of the main module's import, where it failed
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)

    def warm(self) -> None:
        """Import DALI and the worker's modules, parse DALI's own traced files and the main
        module's file for DALI's capture, import the storage backends the script's earlier
        runs opened (:mod:`workers.startup._warm_storage`), and then the trainer's main module
        (:meth:`_import_main`) where its top level only defines (:func:`only_defines`), before
        any request needs them: a server forked at the end of ``import loader`` does all of it
        while the trainer goes on with its own imports and set-up, not after the first
        ``Loader(...)``. A main module whose top level does more (a script without a
        ``__main__`` guard, which may never make a Loader) is imported at the first one, as
        before."""
        from .process import prepare_worker_server

        with _frozen_after():
            prepare_worker_server([self._setup.main_path] if self._setup.main_path else [])
            with startup.span("storage backends"):
                startup.warm(self._setup.main_path or self._setup.main_name, self._waited_for)
            if only_defines(main_file(self._setup)) and not self._waited_for():
                self._import_main()

    def _waited_for(self) -> bool:
        """Whether a request from the trainer waits (a loader was made): the rest of the warm-up
        is then left out where it guesses (the storage backends of earlier runs) and done at
        that request where it is needed (its definition's needs, the main module)."""
        readable, _, _ = select.select([self._sock], [], [], 0)
        return bool(readable)

    def _import_main(self) -> None:
        """Import the trainer's main module once (:func:`import_main`); one that fails is
        imported by each worker, which reports the error (module docstring)."""
        if self._main_state != "pending":
            return
        one_math_thread()
        try:
            with startup.span("main module"):
                imported = import_main(self._setup)
            self._main_state = "imported" if imported else "none"
        except BaseException:  # each worker reports it (docstring)
            self._main_state = "failed"
            self._main_error = traceback.format_exc()
            logger.debug("worker server: the main module did not import", exc_info=True)

    def serve(self) -> None:
        """Serve until the trainer closes its socket (it exited, or asked the server to stop),
        then wait for the workers forked so far: each one's exit code still reaches its
        trainer, so a loader open when the server was stopped keeps its workers. When the
        trainer itself is gone, its workers follow it at once; the server waits for them at most
        :data:`ORPHANED_WAIT` seconds."""
        trainer = os.getppid()
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        signal.set_wakeup_fd(self._wake_write)
        orphaned_since: float | None = None
        with selectors.DefaultSelector() as selector:
            selector.register(self._sock, selectors.EVENT_READ)
            selector.register(self._wake_read, selectors.EVENT_READ)
            serving = True
            while serving or self._statuses:
                for key, _events in selector.select(None if serving else 1.0):
                    if key.fileobj is self._sock:
                        received = sw.receive_request(self._sock)
                        if received is None:
                            serving = False
                            selector.unregister(self._sock)
                            continue
                        self._handle(*received)
                    else:
                        with contextlib.suppress(BlockingIOError):
                            while os.read(self._wake_read, 4096):
                                pass
                self._reap()
                if not serving and os.getppid() != trainer:
                    now = time.monotonic()
                    orphaned_since = orphaned_since or now
                    if now - orphaned_since > ORPHANED_WAIT:
                        self._kill_left()
                        return

    def _handle(self, request: sw.Request, fds: list[int]) -> None:
        if isinstance(request, sw.Fork):
            self._fork(request, fds)
            return
        for fd in fds:
            os.close(fd)
        if isinstance(request, sw.Prepare):
            self._prepare_frozen(request)
        else:
            raise TypeError(f"unexpected worker server request {type(request).__name__}")

    def _prepare(self, request: sw.Prepare) -> None:
        self._import_main()
        with startup.span("the loader's modules"):
            self._import_modules(request)
        if request.needs:
            with startup.span("the dataset's readers"):
                startup.import_needs(request.needs)

    def _prepare_frozen(self, request: sw.Prepare) -> None:
        with _frozen_after():
            self._prepare(request)

    def _import_modules(self, request: sw.Prepare) -> None:
        """The modules of the loader's functions, and DALI's analysis of their files."""
        from .process import warm_source_analysis

        one_math_thread()
        for name in request.modules:
            if name in ("__main__", "__mp_main__"):
                continue
            try:
                __import__(name)
            except BaseException:  # the worker that needs it reports it
                logger.debug("worker server: %s did not import", name, exc_info=True)
        warm_source_analysis(request.files)
        leave_to_trainer()  # again: a main module may install its handlers at its top level

    def _fork(self, request: sw.Fork, fds: list[int]) -> None:
        status = socket.socket(fileno=fds[0])
        worker_fds = fds[1:]
        pid = os.fork()
        if pid == 0:
            status.close()
            self._start_child(worker_fds)
        for fd in worker_fds:
            os.close(fd)
        with contextlib.suppress(OSError):  # the trainer closed it: nobody waits for the worker
            sw.send_status(status, pid)
        self._statuses[pid] = status
        logger.debug("worker server: forked %s, pid %d", request.name, pid)

    def _start_child(self, fds: list[int]) -> NoReturn:
        """In the forked child: drop the server's descriptors and become the worker."""
        startup.process_started()
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            self._sock.close()
            os.close(self._wake_read)
            os.close(self._wake_write)
            for other in self._statuses.values():
                other.close()
            if self._main_state == "failed":
                _main_failed(self._main_error)
            _start_forked_worker(fds)
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
        except BaseException:
            with contextlib.suppress(Exception):
                traceback.print_exc()
        _exit(code)

    def _kill_left(self) -> None:
        """SIGKILL the workers of a gone trainer still there after :data:`ORPHANED_WAIT` (they
        ignore the trainer's signals, and one stuck before it watches its liveness pipe would
        never exit), and reap them."""
        for pid in list(self._statuses):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                logger.debug("worker server: killed pid %d, its trainer gone", pid)
        for pid in list(self._statuses):
            with contextlib.suppress(OSError):
                os.waitpid(pid, 0)
            self._statuses.pop(pid).close()

    def _reap(self) -> None:
        while self._statuses:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            sock = self._statuses.pop(pid, None)
            if sock is None:
                continue
            with sock, contextlib.suppress(OSError):
                sw.send_status(sock, os.waitstatus_to_exitcode(status))


@contextlib.contextmanager
def _frozen_after() -> Iterator[None]:
    """Around the server's imports (DALI's, the storage backends', the main module's): no
    garbage collection while they run, then every object they made moved to the permanent
    generation (``gc.freeze()``), so that the workers forked afterwards share those pages and
    never scan them. An import makes objects by the hundred thousand, and each few hundred set
    off a collection that walks the young ones: with collection off, DALI's import, s3fs's and
    botocore's S3 data took a median 3.2 s instead of 6.1 s (five runs each on the shared 2-core
    machine at load 10); what they leave as garbage (a few cycles) is frozen with the rest.
    The collector is on again afterwards if it was (the workers inherit it)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def _main_failed(error: str) -> NoReturn:
    """A worker forked from a server whose import of the main module failed: that import's
    traceback on this worker's stderr (where a spawned worker's own would be), and exit code 1.
    Not imported again here: the script's top level has already run once in the server, which
    may have started native thread pools (torch's OpenMP on a model built at the top) that no
    fork of it has, and a second run would wait for them for ever."""
    with contextlib.suppress(Exception):
        sys.stderr.write(error)
        sys.stderr.write(
            "(raised in the worker server as it imported the trainer's main module for its "
            "workers, as a spawned worker imports it)\n"
        )
        sys.stderr.flush()
    _exit(1)


def _start_forked_worker(fds: list[int]) -> None:
    """A forked child's start: read :class:`~ipc.server_wire.WorkerStart` from the start pipe,
    take the trainer's environment, directory and path, then run the worker
    (:func:`workers.process._entry.run_worker`, which does not return)."""
    start_fd, conn_fd, stack_fd, alive_fd = fds
    record = sw.read_all(start_fd)
    os.close(start_fd)
    if not record:  # the trainer closed the start pipe unwritten: it is gone, or stopping
        _exit(0)
    start = pickle.loads(record)
    if not isinstance(start, sw.WorkerStart):
        raise TypeError(f"a worker's start record, not {type(start).__name__}")
    os.environ.clear()
    os.environ.update(start.environ)
    os.chdir(start.cwd)
    sys.path[:] = start.sys_path
    spec = pickle.loads(start.spec)
    from .process import run_worker

    run_worker(
        spec,
        Connection(conn_fd),
        Connection(stack_fd, readable=False),
        Connection(alive_fd, writable=False),
    )
