"""One epoch of a Loader: what the loader and the iterator the user holds share, the iterator
itself, accelerate's dataloader protocol, and the sampler trainers call ``set_epoch`` on. Runs in
the trainer.

References go one way, so that dropping a Loader closes it at once (its finalizer runs when the
last reference goes, not when the cyclic garbage collector gets to it)::

    Loader ──owns──► Run ──owns──► Epoch ◄──shares── EpochIterator ──keeps alive──► Loader
                      ▲                                   │
                      └────────── asks for batches ───────┘
    Loader ──owns──► EpochSampler ┈┈weak┈┈► Loader
    accelerate's GradientState ┈┈weak┈┈► Epoch

An :class:`Epoch` refers to neither; an iterator keeps its loader alive (``iter(Loader(...))``
alone is enough), and nothing the loader holds refers back to the loader or to an iterator.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from typing import TYPE_CHECKING, Any

from ..errors import LoaderClosedError

if TYPE_CHECKING:
    from .. import Loader
    from ._checkpoint import Resume
    from ._run import Run


class Epoch:
    """One epoch as the loader delivers it: made by ``iter(loader)``, started by the first
    ``next()``, over at its last batch. The loader owns the newest one (between epochs, the one
    that ended); its iterator shares it.

    It is also what registers with accelerate's ``GradientState`` (``end_of_dataloader``,
    ``remainder``): under an ``Accelerator`` with gradient accumulation, gradients are
    synchronised at the epoch's last batch.
    """

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch  # settled when it starts (set_epoch may change it until then)
        self.started = False
        self.finished = False
        self.replaced = False
        self.resume: Resume | None = None  # the loaded state it goes on from, if any
        self.first_step = 0  # the rank's step of its first batch (> 0 in a resumed epoch)
        self.delivered = 0  # batches handed out in this run of the epoch
        self.expected: int | None = None  # batches it hands out in all, when known
        self.end_of_dataloader = False  # accelerate: the last batch was handed out
        self.remainder = -1  # accelerate: no samples of the last batch are duplicates to drop
        self.accelerate: Any = None  # accelerate's GradientState, while registered with it

    @property
    def in_progress(self) -> bool:
        return self.started and not self.finished

    @property
    def next_step(self) -> int:
        """The rank's step in the epoch of the next batch handed out (``batch.info.step``)."""
        return self.first_step + self.delivered

    def begin(
        self, epoch: int, expected: int | None, resume: Resume | None = None, first_step: int = 0
    ) -> None:
        """Started as ``epoch``, with ``expected`` batches to hand out (from ``resume``'s
        position, whose ``first_step`` batches this rank received before)."""
        self.epoch, self.expected, self.resume, self.first_step = (
            epoch,
            expected,
            resume,
            first_step,
        )
        self.started = True

    def finish(self) -> bool:
        """Over (its ``StopIteration``); False when it was over already."""
        over = not self.finished
        self.finished = True
        return over

    def replace(self) -> None:
        """Replaced by a newer epoch or a loaded state: its iterator is done."""
        self.replaced = True

    def abort(self) -> None:
        """Left half-delivered: over and replaced."""
        self.finished = self.replaced = True

    def handed_out(self) -> None:
        """One more batch; the epoch's last one ends it now, not at a ``next()`` that a trainer
        stopping after ``len()`` batches never makes."""
        self.delivered += 1
        if self.expected is not None and self.delivered >= self.expected:
            self.finished = True
            self.end_of_dataloader = True

    def take_back(self, step: int) -> None:
        """The batch of the rank's ``step`` did not reach the user after all (an interruption
        stopped ``next()``): not counted, if :meth:`handed_out` had counted it."""
        if self.next_step > step:
            self.delivered -= 1
            self.finished = self.end_of_dataloader = False

    def join_accelerate(self) -> None:
        """Register with accelerate's ``GradientState`` when an ``Accelerator`` exists in this
        process (nothing of accelerate is imported or created here). It keeps a weak
        reference."""
        state = sys.modules.get("accelerate.state")
        gradient_state = getattr(state, "GradientState", None)
        if gradient_state is None or not getattr(gradient_state, "_shared_state", None):
            return
        try:
            self.accelerate = gradient_state()
            self.accelerate._add_dataloader(self)
        except Exception:  # another accelerate version: the protocol is an extra, not a must
            self.accelerate = None

    def leave_accelerate(self) -> None:
        if self.accelerate is not None:
            with contextlib.suppress(ValueError):
                self.accelerate._remove_dataloader(self)
            self.accelerate = None


class EpochIterator:
    """One epoch of a Loader. Obtained from ``iter(loader)``; started by its first ``next()``.

    ``len(iterator)`` is the number of batches it still yields. It keeps its loader alive (so
    ``iter(Loader(...))`` alone is enough) and asks the loader's run for each batch; it also
    shows accelerate's ``end_of_dataloader`` and ``remainder`` of its epoch.
    """

    def __init__(self, loader: Loader, run: Run, epoch: Epoch) -> None:
        self._loader = loader  # (only to keep it alive: dropping it would close the run)
        self._run = run
        self._epoch = epoch

    def __iter__(self) -> EpochIterator:
        return self

    def __next__(self) -> Any:
        return self._run.next_batch(self._epoch)

    def __len__(self) -> int:
        epoch = self._epoch
        if epoch.finished or epoch.replaced:
            return 0
        if epoch.started:
            if epoch.expected is None:
                raise TypeError("the length of this epoch is unknown for this source")
            return epoch.expected - epoch.delivered
        return self._loader.remaining()

    @property
    def epoch(self) -> int:
        """The epoch this iterator runs (settled at its first ``next()``)."""
        return self._epoch.epoch

    @property
    def end_of_dataloader(self) -> bool:
        return self._epoch.end_of_dataloader

    @property
    def remainder(self) -> int:
        return self._epoch.remainder


class EpochSampler:
    """``loader.sampler`` (and ``loader.batch_sampler``): what trainers reach for at each epoch's
    start. ``set_epoch(e)`` is ``loader.set_epoch(e)``: Lightning's ``_set_sampler_epoch`` calls
    it on ``dataloader.sampler`` and ``dataloader.batch_sampler.sampler`` (both this object, so
    once). ``batch_size`` is the loader's, for code that reads a batch sampler's (DeepSpeed).

    It is neither a torch ``Sampler`` nor iterable, so nothing mistakes the loader for a
    ``DataLoader`` whose sampler it could replace. It refers to its loader weakly: the loader
    owns it, and a sampler kept after its loader was dropped raises ``LoaderClosedError``.
    """

    __slots__ = ("__weakref__", "_loader")

    def __init__(self, loader: Loader) -> None:
        self._loader = weakref.ref(loader)

    def _target(self) -> Loader:
        loader = self._loader()
        if loader is None:
            raise LoaderClosedError("the loader of this sampler was dropped (and so closed)")
        return loader

    def set_epoch(self, epoch: int) -> None:
        """The loader's next ``iter()`` runs ``epoch`` (see :meth:`Loader.set_epoch`)."""
        self._target().set_epoch(epoch)

    @property
    def sampler(self) -> EpochSampler:
        """Itself: a ``batch_sampler.sampler`` is the same object as ``sampler``."""
        return self

    @property
    def batch_size(self) -> int:
        return int(self._target().batch_size)

    def __repr__(self) -> str:
        loader = self._loader()
        where = "dropped" if loader is None else f"next epoch {loader.epoch}"
        return f"<EpochSampler of a Loader: {where}>"
