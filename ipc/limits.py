"""What a container lets this process use: CPUs and memory under its cgroup, and the kernel's
out-of-memory kills. Runs in the trainer and in the workers; reads files, starts nothing.

Docker's ``--cpus`` and ``--memory``, Kubernetes' ``limits.cpu`` and ``limits.memory`` and
systemd's ``CPUQuota=``/``MemoryMax=`` all end up as cgroup files, which ``os.cpu_count()``,
``os.sched_getaffinity`` and ``psutil.virtual_memory()`` do not read:

- cgroup v2: ``cpu.max`` (``quota period`` or ``max period``), ``memory.max``,
  ``memory.current`` and ``memory.events`` (``oom_kill N``);
- cgroup v1: ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (quota ``-1``: none),
  ``memory.limit_in_bytes``, ``memory.usage_in_bytes`` and ``memory.oom_control``
  (``oom_kill N``, Linux 4.13 and later).

The process's own cgroup comes from ``/proc/self/cgroup`` and each hierarchy's mount point (and
the root it mounts, in a cgroup namespace ``/``) from ``/proc/self/mountinfo``. A limit set on an
ancestor binds its children too, so each reading is the tightest from the process's cgroup up to
the mount point. Everything here returns None (or ``{}``) where a file is missing or unreadable:
no cgroup, another OS, a sandbox that hides them.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

#: A v1 memory limit at or above this is "no limit" (the kernel writes its page-rounded
#: maximum, 9223372036854771712, when none is set).
_V1_UNLIMITED = 1 << 60

_PROC = Path("/proc")

#: ``oom_score_adj`` of the worker server and of each worker (the trainer keeps its own, 0 by
#: default): when a container's memory runs out the kernel kills a worker, which the loader names
#: and may replace, rather than the trainer, whose death ends the job with no word.
SERVER_OOM_SCORE_ADJ = 300
WORKER_OOM_SCORE_ADJ = 500


@dataclass(frozen=True)
class Hierarchy:
    """One mounted cgroup hierarchy that holds a controller: where it is mounted, the part of
    the cgroup tree it mounts, and this process's cgroup path in it."""

    version: int  # 1 or 2
    mount_point: Path
    mount_root: str
    path: str

    def directories(self) -> Iterator[Path]:
        """This process's cgroup directory, then each ancestor up to the mount point."""
        path = self.path
        if self.mount_root != "/" and (
            path == self.mount_root or path.startswith(self.mount_root + "/")
        ):
            path = path[len(self.mount_root) :]
        elif self.mount_root != "/":
            # a namespace whose mount root is not on the path: only the mount point is ours
            path = "/"
        parts = [part for part in path.split("/") if part]
        for depth in range(len(parts), -1, -1):
            yield self.mount_point.joinpath(*parts[:depth])


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None


def _mounts(proc: Path) -> list[tuple[str, Path, str, set[str]]]:
    """(filesystem type, mount point, mount root, super options) of each cgroup mount."""
    text = _read(proc / "self" / "mountinfo")
    if text is None:
        return []
    found = []
    for line in text.splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        point = fields[4].replace("\\040", " ")
        found.append((tail[0], Path(point), fields[3], set(tail[2].split(","))))
    return found


@functools.lru_cache(maxsize=16)
def hierarchy(controller: str, proc: Path = _PROC) -> Hierarchy | None:
    """The hierarchy that holds ``controller`` ("cpu", "memory") for this process: its v1
    hierarchy when one is mounted, else the unified (v2) one when it enables the controller.
    Read once per process: a process stays in the cgroup it started in (the limits in it are
    read anew each time)."""
    membership = _read(proc / "self" / "cgroup")
    if membership is None:
        return None
    v1: dict[str, str] = {}
    unified: str | None = None
    for line in membership.splitlines():
        number, _, rest = line.partition(":")
        names, _, path = rest.partition(":")
        if number == "0" and names == "":
            unified = path
        for name in names.split(","):
            if name:
                v1[name] = path
    mounts = _mounts(proc)
    if controller in v1:
        for kind, point, root, options in mounts:
            if kind == "cgroup" and controller in options:
                return Hierarchy(1, point, root, v1[controller])
    if unified is not None:
        for kind, point, root, _options in mounts:
            if kind != "cgroup2":
                continue
            enabled = _read(point / "cgroup.controllers") or ""
            if controller in enabled.split():
                return Hierarchy(2, point, root, unified)
    return None


def cpu_quota(proc: Path = _PROC) -> float | None:
    """The CPUs this process's cgroup may keep busy (quota / period: 0.5, 2.0...), the tightest
    from its cgroup up; None when no quota is set or none can be read."""
    found = hierarchy("cpu", proc)
    if found is None:
        return None
    tightest: float | None = None
    for directory in found.directories():
        quota: float | None = None
        if found.version == 2:
            text = _read(directory / "cpu.max")
            if text:
                parts = text.split()
                if len(parts) == 2 and parts[0] != "max":
                    quota = _ratio(parts[0], parts[1])
        else:
            q, p = _read(directory / "cpu.cfs_quota_us"), _read(directory / "cpu.cfs_period_us")
            if q is not None and p is not None and q.lstrip("-").isdigit() and int(q) > 0:
                quota = _ratio(q, p)
        if quota is not None and (tightest is None or quota < tightest):
            tightest = quota
    return tightest


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def quota_cpus(quota: float | None) -> int | None:
    """Whole CPUs within a quota: 0.5 -> 1 (at least one), 1.5 -> 1, 2.0 -> 2."""
    if quota is None:
        return None
    return max(1, math.floor(quota + 1e-9))


@dataclass(frozen=True)
class MemoryLimit:
    """The tightest memory limit over this process's cgroup and its ancestors, in bytes, with
    that cgroup's usage now (page cache included, as the kernel counts it against the limit)."""

    limit: int
    usage: int
    directory: Path

    @property
    def room(self) -> int:
        return max(0, self.limit - self.usage)


def memory_limit(proc: Path = _PROC) -> MemoryLimit | None:
    """The memory limit that binds this process first (least room left), or None."""
    found = hierarchy("memory", proc)
    if found is None:
        return None
    limit_file, usage_file = (
        ("memory.max", "memory.current")
        if found.version == 2
        else ("memory.limit_in_bytes", "memory.usage_in_bytes")
    )
    best: MemoryLimit | None = None
    for directory in found.directories():
        limit, usage = _read(directory / limit_file), _read(directory / usage_file)
        if limit is None or not limit.isdigit() or usage is None or not usage.isdigit():
            continue
        if int(limit) >= _V1_UNLIMITED:
            continue
        candidate = MemoryLimit(int(limit), int(usage), directory)
        if best is None or candidate.room < best.room:
            best = candidate
    return best


def available_memory(proc: Path = _PROC) -> int:
    """Bytes this process may still take: the memory the machine has available, or the room
    left under its cgroup's limit when that is less."""
    return _available(memory_limit(proc))


def _available(memory: MemoryLimit | None) -> int:
    import psutil

    available = int(psutil.virtual_memory().available)
    return available if memory is None else min(available, memory.room)


def oom_kills(proc: Path = _PROC) -> dict[str, int]:
    """Counters of the kernel's out-of-memory kills that can see this process's: each memory
    cgroup's from its own up (v2 ``memory.events``, v1 ``memory.oom_control``) by directory,
    and the whole machine's (``/proc/vmstat``) as ``"vmstat"``. Compare two readings: a counter
    that grew names an OOM kill between them."""
    counts: dict[str, int] = {}
    vmstat = _read(proc / "vmstat")
    if vmstat is not None:
        for line in vmstat.splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill" and value.strip().isdigit():
                counts["vmstat"] = int(value)
    found = hierarchy("memory", proc)
    if found is not None:
        events = "memory.events" if found.version == 2 else "memory.oom_control"
        for directory in found.directories():
            text = _read(directory / events)
            if text is None:
                continue
            for line in text.splitlines():
                name, _, value = line.partition(" ")
                if name == "oom_kill" and value.strip().isdigit():
                    counts[str(directory)] = int(value)
    return counts


def oom_grew(before: dict[str, int], after: dict[str, int]) -> list[str]:
    """The counters of :func:`oom_kills` that grew from ``before`` to ``after``."""
    return [name for name, value in after.items() if value > before.get(name, value)]


@dataclass(frozen=True)
class Limits:
    """What this process may use, as the loader budgets it: ``cpus`` = its affinity, cut to the
    whole CPUs of its cgroup's quota; ``memory_available`` = what the machine has available,
    cut to the room under the cgroup's memory limit."""

    affinity: int
    cpu_quota: float | None
    memory_limit: int | None
    memory_usage: int | None
    memory_available: int

    @property
    def cpus(self) -> int:
        return within_quota(self.affinity, self.cpu_quota)

    def describe(self) -> str:
        """One line: the CPUs and memory, and which limit set each."""
        cpu = f"CPUs: {self.cpus} (affinity {self.affinity}"
        cpu += (
            f", cgroup quota {self.cpu_quota:.2f} CPU)" if self.cpu_quota else ", no cgroup quota)"
        )
        memory = f"memory: {self.memory_available / 2**20:,.0f} MiB available"
        if self.memory_limit is not None:
            used = self.memory_usage or 0
            memory += (
                f" (cgroup limit {self.memory_limit / 2**20:,.0f} MiB, "
                f"{used / 2**20:,.0f} MiB of it in use)"
            )
        else:
            memory += " (no cgroup limit)"
        return f"{cpu}; {memory}"


def affinity() -> int:
    """CPUs this process may run on (its affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def usable_cpus(proc: Path = _PROC) -> int:
    """CPUs this process may use: its affinity, cut to the whole CPUs of its cgroup's CPU quota
    (a container's ``--cpus`` / ``limits.cpu``: 0.5 and 1.5 give 1), at least 1."""
    return within_quota(affinity(), cpu_quota(proc))


def within_quota(cpus: int, quota: float | None) -> int:
    """``cpus`` cut to the whole CPUs of ``quota`` (None: no quota), at least 1."""
    whole = quota_cpus(quota)
    return cpus if whole is None else max(1, min(cpus, whole))


def read_limits(proc: Path = _PROC) -> Limits:
    """This process's :class:`Limits` now."""
    memory = memory_limit(proc)
    return Limits(
        affinity=affinity(),
        cpu_quota=cpu_quota(proc),
        memory_limit=None if memory is None else memory.limit,
        memory_usage=None if memory is None else memory.usage,
        memory_available=_available(memory),
    )


def raise_oom_score(at_least: int) -> None:
    """Make this process the kernel's likelier pick when memory runs out: its
    ``oom_score_adj`` to ``at_least`` (at most 1000) where it is lower, so that a worker the
    loader can replace goes before the trainer it feeds. Any process may raise its own; nothing
    happens where the file cannot be written."""
    path = _PROC / "self" / "oom_score_adj"
    current = _read(path)
    if current is None or not current.lstrip("-").isdigit():
        return
    wanted = min(1000, at_least)
    if wanted <= int(current):
        return
    try:
        path.write_text(str(wanted), encoding="ascii")
    except OSError:
        return
