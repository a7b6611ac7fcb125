"""Inside a container's limits, made with real cgroups (as Docker's ``--cpus`` and ``--memory``
and Kubernetes' ``limits`` make them): a trainer subprocess is moved into a fresh cgroup before
it runs, and everything it starts (the worker server, the workers) is in it too.

- a CPU quota of 1 or 0.5 CPU: ``num_workers="auto"``, the default threads and the doctor count
  the quota's CPUs, not the host's;
- a memory limit: the budget and ``stats().limits`` read it, and a worker the kernel's
  out-of-memory killer takes is named as such, with its shard and step.

Skipped, with the reason, where cgroups cannot be made (no root, no writable hierarchy)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from loader.config._env import OVERSUBSCRIBE
from tests.cgroups import Cgroup, cgroup
from tests.container_pipelines import HOG_SAMPLE

ROOT = Path(__file__).resolve().parents[2]
MIB = 2**20

AUTO_SCRIPT = """
import json
from loader import Loader
from tests.pipelines import cast_step, id_source

if __name__ == "__main__":
    with Loader(id_source, cast_step, batch_size=4, num_workers="auto") as loader:
        ids = sorted(int(i) for batch in loader for i in batch["id"].reshape(-1))
        stats = loader.stats()
        print(json.dumps({
            "ids": ids,
            "workers": loader.num_workers,
            "threads": loader.config.num_threads,
            "budget": loader.config.memory_limit,
            "cpus": stats.cpus,
            "quota": stats.limits.cpu_quota,
            "limit_cpus": stats.limits.cpus,
            "memory_limit": stats.limits.memory_limit,
            "memory_usage": stats.limits.memory_usage,
            "memory_available": stats.limits.memory_available,
        }))
"""

OOM_SCRIPT = """
import json, sys
from loader import Loader, WorkerDiedError
from tests.container_pipelines import hungry_source
from tests.pipelines import cast_step

if __name__ == "__main__":
    ids = []
    try:
        with Loader(hungry_source, cast_step, batch_size=4, num_workers=2) as loader:
            for batch in loader:
                ids.extend(int(i) for i in batch["id"].reshape(-1))
    except WorkerDiedError as error:
        print(json.dumps({
            "out_of_memory": error.out_of_memory,
            "signal": error.signal_name,
            "worker": error.worker,
            "message": str(error),
        }))
        sys.exit(3)
    print(json.dumps({"ids": ids}))
"""


def _run(group: Cgroup, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DALI_LOADER_")}
    env["PYTHONPATH"] = str(ROOT)
    env.pop("PYTEST_XDIST_WORKER_COUNT", None)  # the cgroup is the whole container
    done = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
        preexec_fn=group.enter(),
    )
    left = group.emptied()
    assert not left, f"processes outlived the trainer in the cgroup: {left}"
    return done


def _script(tmp_path: Path, text: str) -> str:
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(text))
    return str(path)


def _last_json(out: str) -> dict[str, Any]:
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.parametrize("quota", [1.0, 0.5])
def test_auto_layout_and_threads_fit_a_cpu_quota(tmp_path: Path, quota: float) -> None:
    """The host's CPUs (2 here, 64 on a node) do not count: the quota's whole CPUs (at least
    one) do, for num_workers="auto", the DALI threads and stats()."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs, to tell the quota from the affinity")
    with cgroup(cpu_quota=quota) as group:
        done = _run(group, _script(tmp_path, AUTO_SCRIPT))
    assert done.returncode == 0, done.stderr[-3000:]
    report = _last_json(done.stdout)
    assert report["quota"] == pytest.approx(quota)
    assert report["cpus"] == report["limit_cpus"] == 1
    assert report["workers"] * report["threads"] <= 1
    assert report["ids"] == list(range(64))  # the epoch, exactly once


def test_the_doctor_reports_and_advises_within_a_half_cpu_quota() -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs, to tell the quota from the affinity")
    with cgroup(cpu_quota=0.5) as group:
        done = _run(
            group,
            *("-m", "loader", "doctor", "--seconds", "2"),
            *("--source", "tests.timing_pipelines:quick_source"),
            *("--step", "tests.timing_pipelines:id_step"),
        )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert re.search(
        r"(?m)^  this process may use CPUs: 1 \(affinity \d+, cgroup quota 0.50 CPU\)", out
    ), out
    assert re.search(r"(?m)^  workers' CPU: [\d.]+ of 1 CPUs", out), out
    for advised in re.findall(r"num_workers=(\d+)", out):
        assert int(advised) <= OVERSUBSCRIBE * 1, out  # within the quota's budget


def test_the_memory_budget_and_stats_read_the_cgroup_limit(tmp_path: Path) -> None:
    limit = 1500 * MIB
    with cgroup(memory_bytes=limit) as group:
        done = _run(group, _script(tmp_path, AUTO_SCRIPT))
    assert done.returncode == 0, done.stderr[-3000:]
    report = _last_json(done.stdout)
    assert report["memory_limit"] == limit
    assert 0 < report["memory_usage"] < limit
    assert report["memory_available"] <= limit - report["memory_usage"]
    # num_workers="auto"'s budget: half of what was left under the limit when the Loader was
    # made (the machine has far more available: 24 GB here)
    assert 0 < report["budget"] <= limit // 2
    assert report["ids"] == list(range(64))


def test_a_worker_the_oom_killer_takes_is_named_with_its_shard(tmp_path: Path) -> None:
    """Sample HOG_SAMPLE's load takes 3 GiB under a 1,200 MiB limit. The kernel kills the
    worker (the workers' oom_score_adj puts them before the trainer); the trainer says so."""
    with cgroup(memory_bytes=1200 * MIB) as group:
        done = _run(group, _script(tmp_path, OOM_SCRIPT))
        counters = (
            (group.directories[0] / "memory.oom_control").read_text()
            if (group.directories[0] / "memory.oom_control").exists()
            else (group.directories[0] / "memory.events").read_text()
        )
    assert done.returncode == 3, done.stdout + done.stderr[-3000:]
    report = _last_json(done.stdout)
    assert re.search(r"(?m)^oom_kill [1-9]", counters), counters
    assert report["out_of_memory"] is True and report["signal"] == "SIGKILL"
    message = report["message"]
    shard = HOG_SAMPLE * 2 // 32  # sharded_source splits 32 ids into 2 contiguous shards
    assert f"worker {shard} (shard {shard}/2" in message, message
    assert "killed by the kernel's out-of-memory killer" in message, message
    assert "limit of 1,200 MiB" in message and "epoch 0" in message, message
    assert "while making step" in message, message


def test_slots_that_crowd_the_memory_limit_are_warned_about() -> None:
    """The warning's judgement, in a process under a real 300 MiB limit: 6 slots of 32 MiB
    are more than half of it; 2 slots of 1 MiB are not."""
    code = textwrap.dedent(
        """
        import json
        from loader.engine._failures import memory_risk
        print(json.dumps([memory_risk([(0, 6, 32 * 2**20)]), memory_risk([(0, 2, 2**20)])]))
        """
    )
    with cgroup(memory_bytes=300 * MIB) as group:
        done = _run(group, "-c", code, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    crowded, fine = _last_json(done.stdout)
    assert fine is None
    assert crowded is not None and "192 MiB" in crowded and "limit of 300 MiB" in crowded


SHM_SCRIPT = """
import functools, json
from loader import Loader
from tests.container_pipelines import large_source
from tests.pipelines import copy_step

if __name__ == "__main__":
    source = functools.partial(large_source, total=64, batch_size=16, nbytes=3 * 512 * 512 * 4)
    with Loader(source, copy_step, batch_size=16, num_workers=2) as loader:
        sizes = [int(batch["id"].nbytes) for batch in loader]
    print(json.dumps({"batches": len(sizes), "bytes": sum(sizes)}))
"""


def test_docker_s_64_mb_dev_shm_is_enough(tmp_path: Path) -> None:
    """Docker gives a container 64 MB of /dev/shm unless told otherwise; the workers' slots are
    memfds, not /dev/shm files, so 48 MiB batches from 2 workers (6 slots each) go through (a
    torch DataLoader(num_workers=2) of the same batches stops with "No space left on device")."""
    script = _script(tmp_path, SHM_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DALI_LOADER_")}
    env["PYTHONPATH"] = str(ROOT)
    shell = (
        "mount -t tmpfs -o size=64m tmpfs /dev/shm || exit 77; "
        f'df -k /dev/shm | tail -1; exec "{sys.executable}" "{script}"'
    )
    try:
        done = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", shell],
            capture_output=True,
            text=True,
            timeout=180,
            cwd=ROOT,
            env=env,
        )
    except FileNotFoundError:
        pytest.skip("no unshare(1) to give the job a /dev/shm of its own")
    if done.returncode == 77 or "unshare failed" in done.stderr:
        pytest.skip(f"cannot mount a 64 MB /dev/shm here: {done.stderr.strip()[-300:]}")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert int(lines[0].split()[1]) == 64 * 1024  # the job saw a 64 MB /dev/shm
    report = json.loads(lines[-1])
    assert report["batches"] == 4 and report["bytes"] == 64 * 3 * 512 * 512 * 4
