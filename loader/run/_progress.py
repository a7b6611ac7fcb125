"""Where a run stands between ``state_dict()`` and the next epoch's start: the one
:class:`Progress` a state encodes, what an epoch not begun yet goes on from, and the batches a
loaded state leaves. Pure functions of what the coordinator reported. Runs in the trainer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ipc.wire import RandomStates, Sampling
from workers import steps_left

from ..config import LoaderConfig
from ..engine import Coordinator
from ._checkpoint import Resume

logger = logging.getLogger("loader")


@dataclass(frozen=True)
class Progress:
    """Where the run stands, as ``state_dict()`` encodes it: ``epoch`` (in progress, or between
    epochs the next one), the loaded state it goes on from (``resume``; its received counts
    and earlier layouts), and per worker of this rank the batches handed out since then and the
    random generator states of its first batch not handed out."""

    epoch: int
    resume: Resume | None
    delivered: tuple[int, ...]
    random: tuple[RandomStates, ...]


def between_epochs(
    coordinator: Coordinator,
    epoch: int,
    pending: Resume | None,
    config: LoaderConfig,
    running: int,
) -> Progress:
    """The :class:`Progress` before ``epoch`` (the next) starts on ``config``'s layout, with the
    state loaded for it (``pending``) or none, the workers running ``running`` of them."""
    workers = config.num_workers
    if pending is not None:
        random = tuple(pending.random_states(shard_indices(config)))
    elif coordinator.next_epoch() == epoch and workers == running:
        random = tuple(coordinator.random_states())
    else:  # set_epoch, or a new layout: the workers start that epoch seeded for it
        random = (b"",) * workers
    return Progress(epoch, pending, (0,) * workers, random)


def left_in(resume: Resume, sampling: Sampling, config: LoaderConfig) -> int:
    """Batches this rank has left in ``resume``'s epoch on ``config``'s layout."""
    return sum(
        steps_left(
            sampling,
            resume.epoch,
            shard_indices(config),
            config.world_size * config.num_workers,
            resume.position,
            ranks=config.world_size,
        )
    )


def shard_indices(config: LoaderConfig) -> list[int]:
    """The global shards of ``config``'s workers."""
    return [shard.index for shard in config.shards]


def log_resume(resume: Resume, left: int) -> None:
    logger.info(
        "resuming epoch %d at %s (%s layout): %d batches received before, %d left on this rank",
        resume.epoch,
        list(resume.position.segments[-1][1]),
        "same" if resume.continues else "new",
        resume.before,
        left,
    )
    if not resume.continues:
        logger.info(
            "random draws restart on a new layout: the samples of epoch %d go on exactly, "
            "DALI's random draws (augmentations) differ from an uninterrupted run's; draw "
            "them from the sample id in load() where they must not",
            resume.epoch,
        )
    elif resume.random is None:
        logger.info(
            "the state has no random generator states (saved before they were kept): the "
            "samples go on exactly, DALI's random draws differ from an uninterrupted run's"
        )
