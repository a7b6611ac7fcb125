"""Agreement across ranks through torch.distributed. Runs in the trainer.

Nothing of ours crosses hosts: when a process group is initialised, each rank's summary is
exchanged with ``all_gather_object`` (gloo on CPU, nccl on GPU, whatever the group uses), and
every rank computes the same verdict from the same gathered list, so every rank raises the same
error naming the rank that disagrees, instead of one rank hanging in a collective later.
"""

from __future__ import annotations

import sys
from typing import Any

from ..errors import AgreementError


def group_size() -> int:
    """World size of the initialised default process group, or 0 when there is none."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return 0
    try:
        if dist.is_available() and dist.is_initialized():
            return int(dist.get_world_size())
    except (RuntimeError, AttributeError):
        return 0
    return 0


def group_rank() -> int:
    """This process's rank in the initialised default process group (0 when there is none): its
    index in :func:`gather`'s list."""
    if group_size() == 0:
        return 0
    import torch.distributed as dist

    return int(dist.get_rank())


def gather(payload: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Every rank's ``payload``, in rank order; None without a process group."""
    size = group_size()
    if size <= 1:
        return None
    import torch.distributed as dist

    gathered: list[Any] = [None] * size
    dist.all_gather_object(gathered, payload)
    return gathered


def check_ranks(what: str, gathered: list[dict[str, Any]] | None) -> None:
    """Raise the same AgreementError on every rank when any rank's payload differs from rank 0's."""
    if not gathered:
        return
    reference = gathered[0]
    for rank, payload in enumerate(gathered[1:], start=1):
        differences = [
            f"{key}: rank {rank} has {payload.get(key)!r}, rank 0 has {reference.get(key)!r}"
            for key in sorted(set(reference) | set(payload))
            if payload.get(key) != reference.get(key)
        ]
        if differences:
            raise AgreementError(
                f"rank {rank} disagrees with rank 0 on the loader's {what}: "
                + "; ".join(differences)
                + ". Every rank must build the Loader with the same arguments and the same "
                "source and step"
            )
