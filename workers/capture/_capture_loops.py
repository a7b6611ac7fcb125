"""The worker's capture loops: one per epoch, or one kept from epoch to epoch. Runs in the worker,
on its main thread (rule 10: at most one capture loop at a time, always on that thread).

An epoch's loop ends with its source, except over a ``sharded_source``/``sharded_files`` root,
captured and without feeders: there one loop runs every epoch in turn (the source's feed state is
set ``continuous``), the worker ends each epoch by its known step count, and the loop stays
suspended between epochs -- DALI's prefetch has already started on the next epoch's first batch
(as it does for a reader) when the trainer starts that epoch. :class:`CaptureLoops` owns that
kept loop and the epoch its next batch belongs to.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from ipc import wire

from .. import dali
from ..spec import WorkerSpec
from ._sources import Sources


class CaptureLoops:
    """Opens each epoch's capture loop, and keeps the one of a continuous source."""

    def __init__(self, spec: WorkerSpec) -> None:
        self._spec = spec
        #: the loop kept from one epoch to the next, and the epoch its next batch belongs to
        self._stream: Iterator[Any] | None = None
        self._stream_epoch: int | None = None

    def epoch_steps(self, sources: Sources, epoch: int, tracing: bool) -> int | None:
        """Batches of ``epoch`` when one capture loop runs on from it into the next epochs;
        None when this epoch's loop ends with the source."""
        sampled = sources.sampled
        # a sharded root, captured, without feeders (they end with each epoch's loop)
        if sampled is None or not self._spec.capture or sources.feeders:
            return None
        steps = sampled.epoch_steps(epoch)
        if self._stream is None and tracing and steps < 2:
            # DALI ends the traced step at the loop's next call; made in the next epoch's
            # frame, that call finds nothing captured. This epoch gets a loop of its own.
            return None
        return steps

    def open(self, sources: Sources, ctx: Any, epoch: int, continuous: bool) -> Iterator[Any]:
        """The capture loop of ``epoch``: its own, or (``continuous``) the one kept for every
        epoch, made at its first epoch."""
        spec = self._spec
        if not continuous:
            sources.feed.set_continuous(False)
            return dali.epoch_iterator(sources.source, spec.batch_size, ctx, spec.capture)
        if self._stream is None:
            assert sources.sampled is not None
            sources.feed.set_continuous(True)
            self._stream = dali.epoch_iterator(sources.source, spec.batch_size, ctx, spec.capture)
            self._stream_epoch = epoch
        elif self._stream_epoch != epoch:
            raise wire.ProtocolError(
                f"StartEpoch({epoch}), but the source's next batches are of epoch "
                f"{self._stream_epoch}"
            )
        self._stream_epoch = epoch + 1
        return self._stream

    def close(self, iterator: Iterator[Any] | None) -> None:
        """End an epoch's loop early (an abort, a failure): the kept one is dropped."""
        if iterator is self._stream:
            self.drop()
        else:
            close_iterator(iterator)

    def drop(self) -> None:
        """End the loop kept between epochs (before the sources are rebuilt, at exit)."""
        stream, self._stream, self._stream_epoch = self._stream, None, None
        close_iterator(stream)


def close_iterator(iterator: Iterator[Any] | None) -> None:
    close = getattr(iterator, "close", None)
    if close is not None:
        with contextlib.suppress(Exception):
            close()
