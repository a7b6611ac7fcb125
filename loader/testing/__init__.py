"""Helpers for the user's tests, and a pytest plugin: the ``leak_check`` fixture fails a test that
leaves loader resources behind; the ``loader_worker_server`` fixture (or ``--loader-worker-server``,
or the ``loader_worker_server`` ini option, for every test) makes a suite's loaders start in a
fraction of a second; :func:`assert_resumes_exactly` checks that a pipeline resumes from a saved
state with the same bytes as an uninterrupted run.

Registered through the ``pytest11`` entry point, so installing the package makes the fixture
available to any test suite. Runs in the test process (the trainer side).

What counts as a leak: a child process of the test process that is still alive after the test
(multiprocessing's own long-lived helpers, the resource tracker and the forkserver, and the
loader's worker server are not ours and are ignored; the workers they fork are), a new file
descriptor to shared memory (a memfd or a ``/dev/shm`` file), a socket, a pipe or an anonymous
inode (eventfd, epoll), and a new entry in ``/dev/shm`` that this test's processes made: one that
the test process or one of its descendants holds open or mapped, or that nobody holds (a file
made and closed but never unlinked) and belongs to this user (a multiprocessing semaphore, which
its resource tracker unlinks after its process exits, only if it is still there
:data:`UNHELD_GRACE` seconds later). A new entry held only by other
processes is another job's (a concurrent test session, a DataLoader's semaphores) and is not
blamed. A leak report names the kinds it found. It also names a Loader the test opened and did
not close: one still open, and one dropped while part of a reference cycle, so that its workers
ran until the garbage collector found it (a Loader dropped otherwise closes at once).

The worker server: Loaders made without ``start_method`` fork their workers from one worker server
per process (:mod:`loader.processes.server`; the default start method, ``"forkserver"``). In a test
session that uses DALI (a module under the root directory that mentions ``nvidia.dali`` or imports
``ndd`` from ``loader`` is imported), the plugin starts that server at the session's start, before
any test runs: under pytest-xdist one per xdist worker (nothing is shared between them), with DALI
imported and the suite's DALI-calling files parsed for DALI's capture, kept for the session. Every
worker of every test is then forked from a copy of the session as it was before the first test (a
test's monkeypatches do not reach later tests' workers), and gets the test's environment, working
directory and import path at the moment it starts, as a spawned worker would.
``--no-loader-worker-server`` (or ``loader_worker_server = false`` in the ini file) leaves the
server to the first loader; ``--loader-worker-server`` (or the ``loader_worker_server`` fixture)
also makes it the start method of Loaders made without one when ``DALI_LOADER_START_METHOD``
says otherwise.

Part of the public face. May import: :mod:`loader.processes` (the server), :mod:`loader.config`
and ``loader._loader``; ``_resume`` holds :func:`assert_resumes_exactly`.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import sys
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import psutil
import pytest

from .. import OPEN_LOADERS
from ..config import check_start_method, set_default_start_method
from ..processes import server as worker_server
from ._resume import assert_resumes_exactly

__all__ = [
    "OpenLoader",
    "Snapshot",
    "assert_resumes_exactly",
    "dali_calling_files",
    "fd_kind",
    "find_leaks",
    "leak_check",
    "loader_leaks",
    "loader_worker_server",
    "open_loaders",
    "shm_holders",
    "snapshot",
    "start_worker_server",
]

_HELPER_MARKERS = ("resource_tracker", "forkserver")
#: Seconds a new multiprocessing semaphore in ``/dev/shm`` that nobody holds has to disappear
#: before it is blamed.
UNHELD_GRACE = 2.0
#: A file's text that names DALI: directly, or as ``ndd`` from this package (``loader._ndd``).
_NAMES_DALI = re.compile(
    r"nvidia\.dali|\bloader\.ndd\b|from\s+loader\s+import\s+(\([^)]*|[^\n]*)\bndd\b"
)
_SEMAPHORE = "sem.mp-"
# What a watched descriptor's /proc/self/fd link starts with, and the kind a leak report names.
# A memfd's link reads "/memfd:NAME (deleted)" (older kernels drop the leading slash).
_WATCHED_FD_KINDS = (
    ("/memfd:", "memfd"),
    ("memfd:", "memfd"),
    ("socket:", "socket"),
    ("pipe:", "pipe"),
    ("/dev/shm/", "/dev/shm file"),
    ("anon_inode:", "anon_inode"),
)


@dataclass(frozen=True)
class Snapshot:
    children: frozenset[int]
    fds: frozenset[tuple[int, str]]
    shm: frozenset[str]


def _helper_pids() -> set[int]:
    helpers = set()
    for child in psutil.Process().children(recursive=True):
        try:
            cmdline = " ".join(child.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if any(marker in cmdline for marker in _HELPER_MARKERS):
            helpers.add(child.pid)
    server = worker_server.server_pid()
    if server is not None:
        helpers.add(server)
    return helpers


def _helper_fds() -> set[int]:
    """This process's descriptors that belong to long-lived helpers: the worker server's socket,
    and every pipe shared with a helper process (multiprocessing's resource tracker or
    forkserver: the same pipe inode is open in that process)."""
    fds = set(worker_server.server_fds())
    shared: set[str] = set()
    for pid in _helper_pids():
        try:
            for name in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{name}")
                if target.startswith("pipe:"):
                    shared.add(target)
        except OSError:
            continue
    if shared:
        for name in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{name}") in shared:
                    fds.add(int(name))
            except OSError:
                continue
    return fds


def _live_children() -> set[int]:
    helpers = _helper_pids()
    alive = set()
    for child in psutil.Process().children(recursive=True):
        if child.pid in helpers:
            continue
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                alive.add(child.pid)
        except psutil.NoSuchProcess:
            continue
    return alive


def fd_kind(target: str) -> str | None:
    """The kind of a watched descriptor from its /proc/self/fd link, or None when not watched."""
    for prefix, kind in _WATCHED_FD_KINDS:
        if target.startswith(prefix):
            return kind
    return None


def _watched_fds() -> set[tuple[int, str]]:
    found = set()
    skip = _helper_fds()
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd in skip:
            continue
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if fd_kind(target) is not None:
            found.add((fd, target))
    return found


def _shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def shm_holders(names: set[str]) -> dict[str, set[int]]:
    """For each ``/dev/shm`` entry of ``names``, the pids of the processes that hold it open or
    mapped (those this user may inspect)."""
    paths = {f"/dev/shm/{name}": name for name in names}
    holders: dict[str, set[int]] = {name: set() for name in names}
    for pid in psutil.pids():
        found: set[str] = set()
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}").removesuffix(" (deleted)")
                if target in paths:
                    found.add(paths[target])
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
                for line in maps:
                    if "/dev/shm/" in line:
                        target = line.split(None, 5)[-1].strip().removesuffix(" (deleted)")
                        if target in paths:
                            found.add(paths[target])
        except OSError:
            continue
        for name in found:
            holders[name].add(pid)
    return holders


def _own_process_tree() -> set[int]:
    me = psutil.Process()
    pids = {me.pid}
    with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
        pids.update(child.pid for child in me.children(recursive=True))
    return pids


def _shm_made_here(new: set[str]) -> list[str]:
    """The new ``/dev/shm`` entries this test's processes made (the module docstring)."""
    if not new:
        return []
    holders = shm_holders(new)
    ours = _own_process_tree()
    uid = os.getuid()
    blamed, unheld = [], []
    for name in sorted(new):
        held_by = holders[name]
        if held_by & ours:
            blamed.append(name)
        elif not held_by:  # (held by other processes only: another job's)
            unheld.append(name)
    # held by nobody: multiprocessing's semaphore of a process that just exited may not be
    # unlinked yet (its resource tracker's work, another job's): still there a moment later,
    # it was left behind
    deadline = time.monotonic() + (UNHELD_GRACE if any(_SEMAPHORE in n for n in unheld) else 0)
    while unheld:
        still = []
        for name in unheld:
            try:
                if os.stat(f"/dev/shm/{name}").st_uid == uid:
                    still.append(name)
            except OSError:
                continue  # gone since: not left behind
        unheld = still
        if time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    return sorted(blamed + unheld)


def snapshot() -> Snapshot:
    # (a worker server forked a moment ago still holds copies of this process's pipes, which
    # would count as the server's now and as this test's once it has released them)
    worker_server.wait_released()
    return Snapshot(
        frozenset(_live_children()), frozenset(_watched_fds()), frozenset(_shm_entries())
    )


def _nothing_new(before: Snapshot) -> bool:
    """No new child, watched descriptor or /dev/shm entry at all (the common case, answered
    without a garbage collection: 0.15 s each with DALI and torch imported)."""
    now = snapshot()
    return (
        not (now.children - before.children)
        and not (now.fds - before.fds)
        and not (now.shm - before.shm)
    )


def find_leaks(before: Snapshot, *, grace: float = 5.0) -> list[str]:
    """What exists now that did not before; new child processes get ``grace`` s to exit."""
    if _nothing_new(before):
        return []
    gc.collect()
    new_children = []
    for pid in _live_children() - before.children:
        try:
            new_children.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    _gone, alive = psutil.wait_procs(new_children, timeout=grace)
    children = sorted(p.pid for p in alive)
    gc.collect()
    now = snapshot()
    before_fds = {fd for fd, _ in before.fds}
    fds = sorted(entry for entry in now.fds - before.fds if entry[0] not in before_fds)
    shm = _shm_made_here(set(now.shm - before.shm))
    problems = []
    if children:
        problems.append(f"child processes still alive: {children}")
    if fds:
        kinds = sorted({str(fd_kind(target)) for _, target in fds})
        problems.append(f"file descriptors left open ({', '.join(kinds)}): {fds}")
    if shm:
        problems.append(f"/dev/shm entries left behind: {shm}")
    return problems


@dataclass(frozen=True)
class OpenLoader:
    """A Loader found open, held weakly (noting it keeps nothing alive), and its workers."""

    loader: weakref.ref[Any]
    pids: tuple[int, ...]


def open_loaders(known: weakref.WeakSet[Any] | None = None) -> list[OpenLoader]:
    """The Loaders open now that are not in ``known``. Call it before any garbage collection:
    a loader alive only through a reference cycle is still open here."""
    found = []
    for loader in list(OPEN_LOADERS):
        if (known is None or loader not in known) and not loader.closed:
            found.append(OpenLoader(weakref.ref(loader), tuple(loader.worker_pids())))
    return found


def loader_leaks(noted: Sequence[OpenLoader]) -> list[str]:
    """Of the loaders ``noted`` open (by :func:`open_loaders`): those the garbage collector
    closed, which were dropped without ``close()`` but lived on in a reference cycle, and those
    still open."""
    if not noted:
        return []
    gc.collect()
    dropped = [entry.pids for entry in noted if entry.loader() is None]
    still_open = [entry.pids for entry in noted if _still_open(entry)]
    problems = []
    if dropped:
        problems.append(
            f"{len(dropped)} Loader(s) dropped without close() while held in a reference cycle: "
            f"their workers (pids {list(dropped)}) ran until the garbage collector found them; "
            "close() each loader (or use `with Loader(...) as loader:`) or break the cycle"
        )
    if still_open:
        problems.append(
            f"{len(still_open)} Loader(s) still open after the test (workers, pids "
            f"{list(still_open)}): close() each loader (or use `with Loader(...) as loader:`)"
        )
    return problems


def _still_open(entry: OpenLoader) -> bool:
    loader = entry.loader()
    return loader is not None and not loader.closed


@pytest.fixture
def leak_check() -> Iterator[None]:
    """Fail the test if it leaves worker processes, descriptors or shared memory behind, or a
    Loader open (or dropped in a reference cycle, open until the garbage collector ran)."""
    before = snapshot()
    known: weakref.WeakSet[Any] = weakref.WeakSet(OPEN_LOADERS)
    yield
    noted = open_loaders(known)  # before find_leaks collects garbage
    problems = loader_leaks(noted) + find_leaks(before)
    if problems:
        pytest.fail("resource leak: " + "; ".join(problems), pytrace=False)


def start_worker_server(files: Sequence[str] = ()) -> str:
    """Start this process's worker server now (DALI imported, nothing run, ``files`` parsed for
    DALI's capture) and make Loaders made without ``start_method`` use it, whatever
    ``DALI_LOADER_START_METHOD`` says; returns how it was started (``fork`` or ``exec``,
    :mod:`loader.processes.server`). The server stays up until the process exits."""
    set_default_start_method("forkserver")
    return worker_server.ensure_running(files)


def dali_calling_files(root: str | os.PathLike[str]) -> list[str]:
    """The files under ``root`` of the modules imported so far that mention DALI, by name or
    through ``from loader import ndd`` (where a suite's sources and steps are): the server
    parses them once for every worker."""
    top = os.path.join(os.path.abspath(root), "")
    files = []
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not isinstance(path, str) or not path.endswith(".py") or not path.startswith(top):
            continue
        try:
            with open(path, encoding="utf-8", errors="replace") as file:
                if _NAMES_DALI.search(file.read()):
                    files.append(path)
        except OSError:
            continue
    return sorted(files)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("dali-capture-loader")
    group.addoption(
        "--loader-worker-server",
        action="store_true",
        dest="loader_worker_server",
        default=None,
        help="start one loader worker server per test process at the session's start (DALI "
        "imported once) and make Loaders made without start_method use it (the default when "
        "the suite uses DALI, unless DALI_LOADER_START_METHOD=spawn)",
    )
    group.addoption(
        "--no-loader-worker-server",
        action="store_false",
        dest="loader_worker_server",
        help="do not start the loader worker server at the session's start (the first Loader "
        "that needs it starts it)",
    )
    parser.addini(
        "loader_worker_server",
        type="bool",
        default=True,
        help="false: as --no-loader-worker-server, for every run",
    )


@pytest.fixture(scope="session")
def loader_worker_server(request: pytest.FixtureRequest) -> Iterator[str]:
    """This test process's loader worker server (see :func:`start_worker_server`): Loaders made
    without ``start_method`` in the session use it. Yields how it was started."""
    how = start_worker_server(dali_calling_files(request.config.rootpath))
    yield how
    set_default_start_method(None)


@pytest.fixture(autouse=True, scope="session")
def _loader_worker_server_option(request: pytest.FixtureRequest) -> None:
    """The worker server for every test of the session (module docstring): forced by
    ``--loader-worker-server``; by default when the suite uses DALI and Loaders made without
    ``start_method`` use the server."""
    config = request.config
    wanted = config.getoption("loader_worker_server", default=None)
    if wanted:
        request.getfixturevalue("loader_worker_server")
        return
    if wanted is False or not config.getini("loader_worker_server"):
        return
    if not worker_server.supported() or check_start_method(None) != "forkserver":
        return
    files = dali_calling_files(config.rootpath)
    if files:
        worker_server.ensure_running(files)
