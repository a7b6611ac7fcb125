"""Which rank a loader is, and what every rank must agree on. Runs in the trainer.

A loader built before a launcher set up its process group (Lightning's DDP, a DataModule's
``__init__``) has a provisional rank; :func:`settle` makes it final at the first epoch (or the
first ``len``/``state_dict``). :class:`RankChecks` runs the cross-rank agreement collectives,
each once per loader, at the points where every rank reaches them.
"""

from __future__ import annotations

from typing import Any

from ..config import LoaderConfig, distributed, package_version, settle_placement
from ..engine import Coordinator


def settle(config: LoaderConfig, *, started: bool) -> tuple[LoaderConfig, bool]:
    """``config`` at its final rank and world size, and whether its workers must be re-laid
    for another shard. ``started``: an epoch already ran or was resumed here (a re-lay is then
    an error). Raises ``ValueError`` when the placement contradicts the process group."""
    if config.placement_source == "torch.distributed" or (
        not config.placement.provisional and distributed.group_size() == 0
    ):
        return config, False
    placement = settle_placement(config.placement)
    if placement is None:
        return config, False
    same = (placement.rank, placement.world_size) == (config.rank, config.world_size)
    if not same and started:
        raise RuntimeError(
            f"the torch.distributed group makes this loader rank {placement.rank} of "
            f"{placement.world_size}, but it already ran or resumed an epoch as rank "
            f"{config.rank} of {config.world_size}: set the process group up before the "
            "first epoch, or build the Loader after it (e.g. in train_dataloader())"
        )
    return config.placed(placement), not same


class RankChecks:
    """Across ranks, when a process group is up: the configuration and epoch length once every
    rank started its workers, the traced signature once every rank traced."""

    def __init__(self) -> None:
        self.configuration_checked = False
        self.deferred = False  # re-laid: the configuration is checked at the first epoch
        self.traced_checked = False

    def defer(self) -> None:
        """The workers were re-laid for a rank a process group settled: the configuration is
        checked across ranks at the first epoch (no collective here: other ranks may not
        re-lay)."""
        self.deferred = True

    def configuration(self, coordinator: Coordinator, config: LoaderConfig) -> None:
        """Every rank's configuration and epoch length agree (a collective)."""
        self.configuration_checked = True
        payload = {
            **config.agreement_payload(),
            "loader_version": package_version(),
            "steps_per_epoch": coordinator.steps_per_epoch(),
        }
        _collective(coordinator, "configuration", payload)

    def traced(self, coordinator: Coordinator, fields: dict[str, Any] | None) -> None:
        """Every rank's traced signature agrees (a collective)."""
        self.traced_checked = True
        payload = dict(fields or {})
        payload.pop("device_id", None)  # each rank drives its own GPU
        _collective(coordinator, "traced signature", payload)

    @staticmethod
    def resumed(coordinator: Coordinator, steps: int) -> None:
        """Every rank resumes an epoch of the same length (a collective)."""
        _collective(coordinator, "resumed epoch length", {"steps": steps})


def _collective(coordinator: Coordinator, what: str, payload: dict[str, Any]) -> None:
    """Compare ``payload`` across ranks; a disagreement fails and closes ``coordinator``'s
    workers before it leaves."""
    try:
        distributed.check_ranks(what, distributed.gather(payload))
    except BaseException as error:
        coordinator.fail(error, "the ranks were comparing their loaders")
        coordinator.close()
        raise
