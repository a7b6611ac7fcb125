"""Starting and replacing a layout's pool of workers. Runs in the trainer.

:class:`Launcher` only starts pools (a :class:`~loader.engine.Coordinator` over a
:class:`~loader.processes.WorkerPool`, waited on until every worker is ready) and replaces one
with another; what to start is the :class:`~loader.run._layout.LayoutPlan`'s decision, and when,
the :class:`~loader.run._run.Run`'s (its construction, an epoch's start). A pool that does not
start is closed before the error leaves.
"""

from __future__ import annotations

import logging
import time
import warnings

from ..config import LoaderConfig
from ..engine import (
    Coordinator,
    Healing,
    Timeline,
    Timeouts,
    TrainerCounters,
    current_stream,
    register_pytree_nodes,
)
from ..errors import LoaderClosedError
from ..processes import WorkerPool

logger = logging.getLogger("loader")


class Launcher:
    """Builds and starts a configuration's pool, and retires a pool for another; every pool
    records into the run's ``timeline`` and ``counters``."""

    def __init__(self, timeline: Timeline, counters: TrainerCounters) -> None:
        self.timeline = timeline
        self.counters = counters

    def pool(self, config: LoaderConfig) -> Coordinator:
        """``config``'s workers and their coordinator, not started yet."""
        if config.output == "torch":
            register_pytree_nodes()
        return Coordinator(
            WorkerPool(config.worker_specs(), config.start_method),
            _healing(config),
            in_order=config.in_order,
            stream_of=current_stream(config.output) if config.device == "gpu" else None,
            timeline=self.timeline,
        )

    def start(
        self, coordinator: Coordinator, config: LoaderConfig, *, replaced: int | None = None
    ) -> None:
        """Start ``coordinator``'s workers and wait until each is ready (closes them and raises
        if they do not start). ``replaced``: what :meth:`retire` returned for the pool this one
        replaces (its start-up counts as a relaunch, not as the loader's start)."""
        try:
            coordinator.start(config.startup_timeout)
        except BaseException:
            coordinator.close()
            raise
        if replaced is None:
            self.counters.ready(time.monotonic(), coordinator.wait_ns)
        else:
            self.counters.relaunched(coordinator.wait_ns - replaced)

    def retire(self, coordinator: Coordinator, config: LoaderConfig) -> int:
        """Close ``coordinator``'s pool (its processes and shared memory) for one of
        ``config``'s layout; returns what :meth:`start` needs to count the relaunch."""
        waited = coordinator.wait_ns - self.counters.startup_wait_ns
        if config.device == "gpu" and coordinator.batches_held():
            warnings.warn(
                f"num_workers='auto' starts {config.layout} while batches of the old workers "
                "are still held: their GPU memory goes with those workers, so they must not be "
                "used any more (drop batches before the next epoch starts, or pass copy=True)",
                RuntimeWarning,
                stacklevel=7,  # retire, _launch, _prepare, _start, next_batch, __next__
            )
        coordinator.close()
        return waited

    @staticmethod
    def started(config: LoaderConfig) -> None:
        """The first pool of a run (or of a rank a process group settled) is ready and
        checked."""
        logger.info(
            "started %d workers (rank %d/%d%s, %d DALI threads each, capture=%s)",
            config.num_workers,
            config.rank,
            config.world_size,
            ", until a process group says otherwise" if config.placement.provisional else "",
            config.num_threads,
            config.capture,
        )


def usable(coordinator: Coordinator | None, *, closed: bool, interrupted: bool) -> Coordinator:
    """``coordinator`` if its pool is open; ``LoaderClosedError`` after the run's ``close()``
    (``closed``) or a failure. ``interrupted``: also one an interruption stopped (its sessions
    still say what was handed out: ``state_dict()`` reads them)."""
    if coordinator is not None and coordinator.failure is not None:
        if coordinator.interrupted and interrupted and not closed:
            return coordinator
        if coordinator.interrupted:
            raise LoaderClosedError(
                f"the loader stopped its workers, {coordinator.failure_reason}; its "
                "state_dict() still describes the batches handed out: load it into a new "
                "Loader to go on"
            ) from coordinator.failure
        raise LoaderClosedError(
            f"the loader was shut down after a failure: {coordinator.failure_reason}"
        ) from coordinator.failure
    if closed or coordinator is None or coordinator.pool.closed:
        raise LoaderClosedError("the loader is closed")
    return coordinator


def _healing(config: LoaderConfig) -> Healing:
    timeouts = Timeouts(
        timeout=config.timeout,
        trace=None if config.timeout is None else config.startup_timeout,
        startup=config.startup_timeout,
    )
    return Healing(
        max_restarts=config.max_restarts,
        on_error=config.on_error,
        max_skipped=config.max_skipped,
        timeouts=timeouts,
    )
