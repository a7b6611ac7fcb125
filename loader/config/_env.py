"""Where this trainer runs: its rank, its GPU and its share of the CPUs. Runs in the trainer."""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ipc import limits
from ipc.limits import usable_cpus  # affinity cut to a container's CPU quota


@dataclass(frozen=True)
class Placement:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    source: str  # "torch.distributed", "environment", "arguments", "launcher" or "default"

    @property
    def provisional(self) -> bool:
        """True when no group, launcher pair or argument fixed the rank: the loader settles it
        from the process group when the first epoch starts (a launcher may set one up later)."""
        return self.source in ("default", "launcher")


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _torch_group() -> tuple[int, int] | None:
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    try:
        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank()), int(dist.get_world_size())
    except (RuntimeError, AttributeError):
        return None
    return None


def discover_placement(rank: int | None, world_size: int | None) -> Placement:
    """An initialised torch.distributed group wins, then RANK/WORLD_SIZE, then the arguments.

    Explicit arguments that contradict the group or the environment raise ``ValueError``, and so
    does only one of RANK and WORLD_SIZE set when neither a group nor the arguments place us.
    """
    if (rank is None) != (world_size is None):
        raise ValueError("pass both rank= and world_size=, or neither")
    if world_size is not None and world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if rank is not None and world_size is not None and not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")

    local_rank = _env_int("LOCAL_RANK")
    local_world = _env_int("LOCAL_WORLD_SIZE")
    found: tuple[int, int] | None = _torch_group()
    how = "torch.distributed"
    if found is None:
        env_rank, env_world = _env_int("RANK"), _env_int("WORLD_SIZE")
        if env_rank is not None and env_world is not None:
            found, how = (env_rank, env_world), "environment"
        elif env_rank is not None and env_world is None and rank is None:
            raise ValueError(
                f"environment variable RANK={os.environ['RANK']!r} is set but WORLD_SIZE is "
                "not: a launcher sets both (torchrun does); set WORLD_SIZE, unset RANK, or "
                "pass rank= and world_size="
            )
        elif env_world is not None and env_rank is None and rank is None:
            # Lightning's DDP launcher sets WORLD_SIZE, LOCAL_RANK and NODE_RANK but not RANK,
            # and sets up the process group later (in fit): a guess, settled at the first epoch
            guess = (local_rank or 0) + (_env_int("NODE_RANK") or 0) * (local_world or 0)
            if not 0 <= guess < env_world:
                guess = local_rank or 0 if 0 <= (local_rank or 0) < env_world else 0
            found, how = (guess, env_world), "launcher"
            if local_world is None and not _env_int("NODE_RANK"):
                local_world = env_world  # one node: every rank shares this machine's CPUs
    if found is not None:
        if rank is not None and (rank, world_size) != found:
            raise ValueError(
                f"rank={rank}, world_size={world_size} contradict {how} "
                f"(rank {found[0]} of {found[1]}); drop the arguments or fix the launcher"
            )
        rank, world_size = found
    elif rank is not None and world_size is not None:
        how = "arguments"
    else:
        rank, world_size, how = 0, 1, "default"
    assert rank is not None and world_size is not None
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size}) ({how})")
    if local_rank is None:
        local_rank = rank if how in ("arguments", "default") else 0
    if local_world is None:
        local_world = 1
    return Placement(rank, world_size, local_rank, local_world, how)


def sharers(local_world_size: int = 1) -> int:
    """Processes that share this machine's CPUs and memory with this one: the local ranks, times
    the pytest-xdist workers when under xdist."""
    count = max(1, local_world_size)
    xdist = _env_int("PYTEST_XDIST_WORKER_COUNT")
    if xdist is not None and xdist > 1:
        count *= xdist
    return count


def cpu_budget(local_world_size: int = 1) -> int:
    """CPUs this rank's workers may use: this process's affinity split among its sharers."""
    return max(1, usable_cpus() // sharers(local_world_size))


#: Workers that leave their CPUs idle (their ``load`` waits on storage) may number up to this
#: many per CPU of their rank's share; workers busy on the CPU, one per CPU.
OVERSUBSCRIBE = 2


def worker_budget(cpus: int, cpu_per_worker: float) -> int:
    """The most workers a rank may run on its share of ``cpus`` CPUs, given the CPUs each worker
    was measured to keep busy: one per CPU, or as many as their CPU use fits when each uses
    less than a CPU, up to :data:`OVERSUBSCRIBE` per CPU."""
    cpus = max(1, cpus)
    if cpu_per_worker <= 0:
        return OVERSUBSCRIBE * cpus
    return max(cpus, min(OVERSUBSCRIBE * cpus, math.floor(cpus / cpu_per_worker)))


def host_facts() -> dict[str, Any]:
    """What the ranks exchange to count the CPUs of each host: its name, this process's CPUs,
    ``LOCAL_WORLD_SIZE`` (None when unset) and the pytest-xdist peers."""
    return {
        "host": socket.gethostname(),
        "node_cpus": usable_cpus(),
        "local_world_size": _env_int("LOCAL_WORLD_SIZE"),
        "peers": sharers(1),
    }


def local_ranks(hosts: Sequence[str], index: int, local_world_size: int | None) -> int:
    """Trainer processes on the host of rank ``index``: ``LOCAL_WORLD_SIZE`` when the launcher
    set it, else the ranks whose host name is that rank's (``hosts``: every rank's, in order)."""
    if local_world_size is not None:
        return max(1, local_world_size)
    return max(1, sum(1 for host in hosts if host == hosts[index]))


def node_shares(gathered: Sequence[Mapping[str, Any]]) -> list[int]:
    """Each rank's CPU budget from every rank's :func:`host_facts`: its host's CPUs split among
    the local ranks (and pytest-xdist peers) there."""
    hosts = [str(facts["host"]) for facts in gathered]
    shares = []
    for index, facts in enumerate(gathered):
        local = local_ranks(hosts, index, facts["local_world_size"])
        shares.append(max(1, int(facts["node_cpus"]) // (local * max(1, int(facts["peers"])))))
    return shares


def default_num_threads(num_workers: int, local_world_size: int = 1) -> int:
    """DALI threads per worker: this process's CPUs split among workers, ranks and xdist peers."""
    return max(1, cpu_budget(local_world_size) // max(1, num_workers))


#: The memory budget of ``num_workers="auto"`` when ``memory_limit`` is not given: this share
#: of the memory available when the Loader is made.
DEFAULT_MEMORY_FRACTION = 0.5


def memory_budget(limit: int | float | None, local_world_size: int = 1) -> int:
    """Bytes this rank's workers may hold: ``limit`` bytes, or a fraction (0, 1] of the memory
    available now (the machine's, or the room under this process's cgroup memory limit when that is
    less) split among this machine's sharers (None: :data:`DEFAULT_MEMORY_FRACTION`)."""
    if limit is None:
        limit = DEFAULT_MEMORY_FRACTION
    if isinstance(limit, bool) or not isinstance(limit, (int, float)):
        raise TypeError(
            "memory_limit must be a number of bytes (int) or a fraction of the available "
            f"memory (float in (0, 1]), got {type(limit).__name__} ({limit!r})"
        )
    if isinstance(limit, int):
        if limit < 1:
            raise ValueError(f"memory_limit must be a positive number of bytes, got {limit}")
        return limit
    if not 0.0 < limit <= 1.0:
        raise ValueError(
            "memory_limit as a float is a fraction of the available memory, in (0, 1]; got "
            f"{limit!r} (pass an int for bytes, e.g. memory_limit=8 * 2**30)"
        )
    available = limits.available_memory()
    return max(1, int(available * limit) // sharers(local_world_size))


def default_device_id(placement: Placement, visible_gpus: int) -> int:
    """``LOCAL_RANK`` under a launcher; under pytest-xdist the xdist worker number modulo the
    visible GPUs (ordinals are relative to ``CUDA_VISIBLE_DEVICES``); else 0."""
    if os.environ.get("LOCAL_RANK"):
        return placement.local_rank
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and worker[2:].isdigit() and visible_gpus > 0:
        return int(worker[2:]) % visible_gpus
    return placement.local_rank % max(1, visible_gpus)


def settle_placement(placement: Placement) -> Placement | None:
    """The placement once the process group is known: None when ``placement`` stands, a new one
    when a provisional placement meets a group that says otherwise. Raises ``ValueError`` when a
    fixed placement contradicts the group, or when a launcher's WORLD_SIZE (without RANK) is
    still not backed by a group at the first epoch."""
    group = _torch_group()
    if group is None:
        if placement.source == "launcher":
            raise ValueError(
                f"environment variable WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} is set but "
                "RANK is not, and no torch.distributed process group was set up by the first "
                "epoch: the loader cannot tell its rank. Set RANK (torchrun does), initialise the "
                "process group before the first epoch, or pass rank= and world_size="
            )
        return None
    if group == (placement.rank, placement.world_size):
        if placement.provisional:
            return dataclasses.replace(placement, source="torch.distributed")
        return None
    if not placement.provisional:
        raise ValueError(
            f"the loader was built as rank {placement.rank} of {placement.world_size} "
            f"({placement.source}), but the torch.distributed group says rank {group[0]} of "
            f"{group[1]}; drop rank=/world_size= or fix the launcher"
        )
    local_rank = _env_int("LOCAL_RANK")
    local_world = _env_int("LOCAL_WORLD_SIZE")
    if local_world is None:
        # a launcher on one node (Lightning's sets NODE_RANK=0): every rank shares this machine
        local_world = group[1] if not _env_int("NODE_RANK") else placement.local_world_size
    return Placement(
        group[0],
        group[1],
        group[0] if local_rank is None else local_rank,
        local_world,
        "torch.distributed",
    )


def package_version() -> str:
    """The installed distribution's version, from its metadata (``pyproject.toml`` states it,
    once); ``0+unknown`` for a checkout on ``sys.path`` that was never installed."""
    from importlib import metadata

    try:
        return metadata.version("dali-capture-loader")
    except metadata.PackageNotFoundError:
        return "0+unknown"
