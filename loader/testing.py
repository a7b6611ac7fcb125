"""Helpers for the user's tests, and a pytest plugin: the ``leak_check`` fixture fails a test that
leaves loader resources behind; :func:`assert_resumes_exactly` checks that a pipeline resumes
from a saved state with the same bytes as an uninterrupted run.

Registered through the ``pytest11`` entry point, so installing the package makes the fixture
available to any test suite. Runs in the test process (the trainer side).

What counts as a leak: a child process of the test process that is still alive after the test
(multiprocessing's own long-lived helpers, the resource tracker and the forkserver, are not
ours and are ignored), a new file descriptor to shared memory (a memfd or a ``/dev/shm`` file),
a socket, a pipe or an anonymous inode (eventfd, epoll), and a new entry in ``/dev/shm``. A leak
report names the kinds it found.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from dataclasses import dataclass

import psutil
import pytest

from ._resume_check import assert_resumes_exactly

__all__ = ["Snapshot", "assert_resumes_exactly", "fd_kind", "find_leaks", "leak_check", "snapshot"]

_HELPER_MARKERS = ("resource_tracker", "forkserver")
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
    return helpers


def _helper_fds() -> set[int]:
    fds: set[int] = set()
    try:
        from multiprocessing import resource_tracker

        fd = getattr(resource_tracker._resource_tracker, "_fd", None)
        if fd is not None:
            fds.add(fd)
    except Exception:
        pass
    try:
        from multiprocessing import forkserver

        server = forkserver._forkserver
        for name in ("_forkserver_alive_fd", "_forkserver_authkey"):
            value = getattr(server, name, None)
            if isinstance(value, int):
                fds.add(value)
    except Exception:
        pass
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


def snapshot() -> Snapshot:
    return Snapshot(
        frozenset(_live_children()), frozenset(_watched_fds()), frozenset(_shm_entries())
    )


def find_leaks(before: Snapshot, *, grace: float = 5.0) -> list[str]:
    """What exists now that did not before; new child processes get ``grace`` s to exit."""
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
    shm = sorted(now.shm - before.shm)
    problems = []
    if children:
        problems.append(f"child processes still alive: {children}")
    if fds:
        kinds = sorted({str(fd_kind(target)) for _, target in fds})
        problems.append(f"file descriptors left open ({', '.join(kinds)}): {fds}")
    if shm:
        problems.append(f"/dev/shm entries left behind: {shm}")
    return problems


@pytest.fixture
def leak_check() -> Iterator[None]:
    """Fail the test if it leaves worker processes, descriptors or shared memory behind."""
    before = snapshot()
    yield
    problems = find_leaks(before)
    if problems:
        pytest.fail("resource leak: " + "; ".join(problems), pytrace=False)
