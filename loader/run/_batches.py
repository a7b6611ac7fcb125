"""What the run hands out: a delivered slot as the user's batch (taken back when ``next()`` is
interrupted before the user has it), and how many batches an epoch has on a rank. Runs in the
trainer.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from workers import steps_per_epoch

from ..config import LoaderConfig
from ..engine import Coordinator, Delivery, TrainerCounters, build_batch
from ._epochs import Epoch

logger = logging.getLogger("loader")


def hand_out(
    coordinator: Coordinator,
    delivery: Delivery,
    config: LoaderConfig,
    counters: TrainerCounters,
    kind: str,
) -> Any:
    """The user's batch over a delivered slot (views, or private copies with ``copy=True``,
    the slot then back to its worker at once), of output ``kind`` (dict, tuple, one array);
    its real rows are counted as handed out."""
    descriptor = delivery.descriptor
    batch = build_batch(
        delivery.arrays,
        delivery.lease,
        descriptor,
        kind,
        delivery.info,
        output=config.output,
        copy=config.copy,
        releases=coordinator.releases.queue,
        owner=delivery.reader,
        cut_padding=config.cut_padding,
        cut_replaced=config.cut_replaced,
    )
    worker, reader = delivery.info.worker, delivery.reader
    del delivery  # (its views: with copy=True the batch holds private copies)
    if config.copy:
        coordinator.release_at_once(worker, reader, descriptor)
    real = config.batch_size - descriptor.padded
    # a row filled in for a skipped sample (on_error="skip") is a repeat, like padding
    real -= sum(1 for row in descriptor.replaced if row < real)
    counters.handed_out(time.monotonic(), real, descriptor.defaulted)
    return batch


def epoch_length(coordinator: Coordinator, config: LoaderConfig) -> int:
    """Batches of a whole epoch on this rank of ``config``; ``TypeError`` when the source
    cannot say."""
    sampling = coordinator.sampling()
    if sampling is not None:
        count = config.world_size * config.num_workers
        return steps_per_epoch(
            sampling.total, count, sampling.batch_size, sampling.drop_last, config.world_size
        )
    steps = coordinator.steps_per_epoch()
    if steps is None:
        raise TypeError(
            "len(loader) is unknown for this source: pass a dataset definition (FilesDataset, "
            "SamplesDataset...) or use sharded_source(), or a reader built "
            "with stick_to_shard=True and pad_last_batch=True (every sample once per epoch, "
            "padded rows flagged in batch.info.padded)"
        )
    return steps


def stop_interrupted(
    coordinator: Coordinator | None, error: BaseException, epoch: Epoch, delivery: Delivery | None
) -> None:
    """``next()`` of ``epoch`` was interrupted (:mod:`loader.engine._interrupts`). Blocked in a
    wait for a batch, nothing was half-done and the workers go on. Anywhere else they are
    stopped (``LoaderClosedError`` from then on, with these words), and ``delivery``, a batch
    that did not reach the user, is not counted. Either way ``state_dict()`` describes the
    batches handed out: a run resumed from it gets the rest, each batch once."""
    if coordinator is None or coordinator.interrupted_cleanly(error):
        return
    if delivery is not None:
        info = delivery.info
        coordinator.take_back(delivery)
        epoch.take_back(info.step)
        doing = (
            f"handing out batch {info.step} of epoch {info.epoch} (worker {info.worker}), "
            "which was not counted as received"
        )
    elif not epoch.started:
        doing = f"starting epoch {epoch.epoch}"
    elif epoch.finished:
        doing = f"ending epoch {epoch.epoch}"
    else:
        doing = f"taking batch {epoch.next_step} of epoch {epoch.epoch}"
    if coordinator.failure is None:
        coordinator.fail(error, doing)
    logger.info(
        "the workers were stopped: %s; state_dict() still describes the batches handed out",
        coordinator.failure_reason,
    )
