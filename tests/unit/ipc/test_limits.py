"""ipc.limits reads a container's CPU quota, memory limit and OOM kills from cgroup files, v1
and v2, from the process's own cgroup up to the mount point (a limit on an ancestor binds).

Here over a /proc and cgroup tree laid out in a temporary directory as the kernel lays them
out (the real cgroups are in tests/integration/test_containers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ipc import limits


def _proc(tmp_path: Path, cgroup: str, mounts: list[str], vmstat: str = "oom_kill 0\n") -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    (proc / "self" / "mountinfo").write_text(
        "".join(f"{30 + i} 23 0:{40 + i} {m}\n" for i, m in enumerate(mounts))
    )
    (proc / "vmstat").write_text(vmstat)
    return proc


def _write(directory: Path, **files: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name.replace("__", ".")).write_text(text)


def test_v2_quota_limit_and_oom_kills_from_the_process_cgroup_up(tmp_path: Path) -> None:
    mount = tmp_path / "cg2"
    _write(mount, cgroup__controllers="cpuset cpu io memory pids\n")
    _write(mount / "job", cpu__max="150000 100000\n", memory__max="max\n", memory__current="1")
    _write(
        mount / "job" / "step",
        cpu__max="max 100000\n",
        memory__max=f"{1200 * 2**20}\n",
        memory__current=f"{200 * 2**20}\n",
        memory__events="low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\n",
    )
    proc = _proc(tmp_path, "0::/job/step\n", [f"/ {mount} rw,nosuid - cgroup2 cgroup2 rw"])
    assert limits.cpu_quota(proc) == pytest.approx(1.5)  # the parent's quota binds
    assert limits.quota_cpus(1.5) == 1 and limits.quota_cpus(0.5) == 1
    assert limits.quota_cpus(2.0) == 2 and limits.quota_cpus(None) is None
    memory = limits.memory_limit(proc)
    assert memory is not None
    assert (memory.limit, memory.usage, memory.room) == (1200 * 2**20, 200 * 2**20, 1000 * 2**20)
    assert memory.directory == mount / "job" / "step"
    before = limits.oom_kills(proc)
    assert before == {"vmstat": 0, str(mount / "job" / "step"): 2}
    (mount / "job" / "step" / "memory.events").write_text("oom 2\noom_kill 3\n")
    assert limits.oom_grew(before, limits.oom_kills(proc)) == [str(mount / "job" / "step")]


def test_v1_quota_and_limit_in_a_cgroup_namespace(tmp_path: Path) -> None:
    """A container mounts its own cgroup as the hierarchy's root: the path in /proc/self/cgroup
    is under the mount's root, and only what is below the mount point can be read."""
    cpu, memory = tmp_path / "cpu", tmp_path / "memory"
    _write(cpu, cpu__cfs_quota_us="50000\n", cpu__cfs_period_us="100000\n")
    _write(
        memory,
        memory__limit_in_bytes=f"{512 * 2**20}\n",
        memory__usage_in_bytes=f"{100 * 2**20}\n",
        memory__oom_control="oom_kill_disable 0\nunder_oom 0\noom_kill 4\n",
    )
    proc = _proc(
        tmp_path,
        "5:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n",
        [
            f"/docker/abc {cpu} ro,nosuid - cgroup cgroup rw,cpu,cpuacct",
            f"/docker/abc {memory} ro,nosuid - cgroup cgroup rw,memory",
        ],
    )
    assert limits.cpu_quota(proc) == pytest.approx(0.5)
    found = limits.memory_limit(proc)
    assert found is not None and found.limit == 512 * 2**20 and found.directory == memory
    assert limits.oom_kills(proc)[str(memory)] == 4


def test_no_quota_and_no_limit_read_as_none(tmp_path: Path) -> None:
    cpu, memory = tmp_path / "cpu", tmp_path / "memory"
    _write(cpu, cpu__cfs_quota_us="-1\n", cpu__cfs_period_us="100000\n")
    _write(memory, memory__limit_in_bytes="9223372036854771712\n", memory__usage_in_bytes="4096\n")
    proc = _proc(
        tmp_path,
        "4:memory:/\n2:cpu:/\n",
        [f"/ {cpu} rw - cgroup cgroup rw,cpu", f"/ {memory} rw - cgroup cgroup rw,memory"],
    )
    assert limits.cpu_quota(proc) is None
    assert limits.memory_limit(proc) is None
    assert limits.cpu_quota(tmp_path / "no-proc") is None  # nothing to read: no limit
    assert limits.oom_kills(tmp_path / "no-proc") == {}


def test_the_tightest_limit_is_the_one_with_least_room(tmp_path: Path) -> None:
    """A parent's limit binds a child whose own is looser, and the other way round."""
    memory = tmp_path / "memory"
    _write(memory / "a", memory__limit_in_bytes="1000", memory__usage_in_bytes="900")
    _write(memory / "a" / "b", memory__limit_in_bytes="5000", memory__usage_in_bytes="100")
    proc = _proc(tmp_path, "4:memory:/a/b\n", [f"/ {memory} rw - cgroup cgroup rw,memory"])
    found = limits.memory_limit(proc)
    assert found is not None and (found.limit, found.room) == (1000, 100)


def test_limits_describe_which_limit_set_each_figure() -> None:
    capped = limits.Limits(
        affinity=8, cpu_quota=0.5, memory_limit=2**30, memory_usage=2**28, memory_available=3 << 28
    )
    assert capped.cpus == 1
    text = capped.describe()
    assert "CPUs: 1 (affinity 8, cgroup quota 0.50 CPU)" in text
    assert "768 MiB available (cgroup limit 1,024 MiB, 256 MiB of it in use)" in text
    free = limits.Limits(
        affinity=4, cpu_quota=None, memory_limit=None, memory_usage=None, memory_available=2**30
    )
    assert free.cpus == 4
    assert (
        free.describe()
        == "CPUs: 4 (affinity 4, no cgroup quota); memory: 1,024 MiB available (no cgroup limit)"
    )
    assert limits.Limits(16, 3.7, None, None, 1).cpus == 3  # whole CPUs within the quota


def test_slots_give_up_their_headroom_before_what_they_need_is_refused() -> None:
    """A ring whose slots with headroom would pass the memory available, while the bytes a
    batch needs fit, is made at the size it needs (it was refused, saying it needed less than
    was available)."""
    from ipc import PAGE, SharedMemoryError, memfd_regions

    available = limits.available_memory()
    create = memfd_regions("test", "worker 0 (shard 0/1)", 2, None)
    arena = create(1, available // PAGE * PAGE, PAGE)  # (2 slots of it: twice what there is)
    try:
        assert arena.slot_size == PAGE
    finally:
        arena.close()
    with pytest.raises(SharedMemoryError, match=r"needs \d+ bytes .* available.* fewer workers"):
        create(2, available, available // PAGE * PAGE)
