"""Real cgroups for the container tests: a fresh cgroup with a CPU quota and/or a memory limit,
and a ``preexec_fn`` that moves a child process into it before it runs Python, as Docker's
``--cpus`` / ``--memory`` put a container's first process. The tests skip (saying why) where
the cgroup file system cannot be written: no root, a read-only mount, another OS."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ipc.limits import Hierarchy, hierarchy


def _parent(controller: str) -> tuple[Hierarchy, Path]:
    found = hierarchy(controller)
    if found is None:
        pytest.skip(f"no cgroup hierarchy with the {controller} controller is mounted")
    parent = next(found.directories())
    if not os.access(parent, os.W_OK):
        pytest.skip(f"cannot create a cgroup under {parent} (not writable: run as root)")
    return found, parent


class Cgroup:
    """One new cgroup per controller asked for (v1), or one with both (v2)."""

    def __init__(self, cpu_quota: float | None = None, memory_bytes: int | None = None) -> None:
        self.directories: list[Path] = []
        name = f"dcl-test-{uuid.uuid4().hex[:12]}"
        wanted = [c for c, v in (("cpu", cpu_quota), ("memory", memory_bytes)) if v is not None]
        try:
            for controller in wanted:
                found, parent = _parent(controller)
                directory = parent / name
                if directory in self.directories:
                    continue  # (v2: one directory holds both)
                if found.version == 2:
                    with contextlib.suppress(OSError):
                        (parent / "cgroup.subtree_control").write_text(f"+{controller}")
                directory.mkdir()
                self.directories.append(directory)
                if controller == "cpu":
                    assert cpu_quota is not None
                    period = 100_000
                    quota = str(max(1000, round(cpu_quota * period)))
                    if found.version == 2:
                        (directory / "cpu.max").write_text(f"{quota} {period}")
                    else:
                        (directory / "cpu.cfs_period_us").write_text(str(period))
                        (directory / "cpu.cfs_quota_us").write_text(quota)
                else:
                    assert memory_bytes is not None
                    if found.version == 2:
                        (directory / "memory.max").write_text(str(memory_bytes))
                        with contextlib.suppress(OSError):
                            (directory / "memory.swap.max").write_text("0")
                    else:
                        (directory / "memory.limit_in_bytes").write_text(str(memory_bytes))
                        with contextlib.suppress(OSError):
                            (directory / "memory.memsw.limit_in_bytes").write_text(
                                str(memory_bytes)
                            )
        except OSError as error:
            self.close()
            pytest.skip(f"cannot set up a cgroup here: {error}")

    def enter(self) -> Callable[[], None]:
        """A ``preexec_fn``: the child joins every cgroup of this one before it execs."""
        procs = [str(directory / "cgroup.procs") for directory in self.directories]

        def join() -> None:
            for path in procs:
                with open(path, "w") as file:
                    file.write("0")  # 0: the writing process itself

        return join

    def pids(self) -> set[int]:
        found: set[int] = set()
        for directory in self.directories:
            with contextlib.suppress(OSError):
                text = (directory / "cgroup.procs").read_text()
                found.update(int(line) for line in text.split())
        return found

    def emptied(self, within: float = 10.0) -> set[int]:
        """The processes still in it after up to ``within`` seconds: a job's worker server and
        workers end on their own when the trainer has gone (they see its pipes close), a
        moment after it."""
        deadline = time.monotonic() + within
        while (left := self.pids()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return left

    def close(self) -> None:
        """Kill whatever is left in it (a leak the test reports first), then remove it."""
        for _ in range(50):
            left = self.pids()
            if not left:
                break
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        for directory in reversed(self.directories):
            with contextlib.suppress(OSError):
                directory.rmdir()
        self.directories.clear()


@contextlib.contextmanager
def cgroup(cpu_quota: float | None = None, memory_bytes: int | None = None) -> Iterator[Cgroup]:
    made = Cgroup(cpu_quota, memory_bytes)
    try:
        yield made
    finally:
        made.close()
