"""The user's objects of an epoch: the iterator ``iter(loader)`` returns, and the sampler
trainers call ``set_epoch`` on. Runs in the trainer.

References go one way, so that dropping a Loader closes it at once (its finalizer runs when the
last reference goes, not when the cyclic garbage collector gets to it)::

    Loader ──owns──► Run ──owns──► Epoch ◄──shares── EpochIterator ──keeps alive──► Loader
                      ▲                                   │
                      └────────── asks for batches ───────┘
    Loader ──owns──► EpochSampler ┈┈weak┈┈► Loader
    accelerate's GradientState ┈┈weak┈┈► Epoch

An :class:`~loader.run.Epoch` refers to neither; an iterator keeps its loader alive
(``iter(Loader(...))`` alone is enough), and nothing the loader holds refers back to the loader
or to an iterator. Both see the loader as an :class:`EpochOwner` (what they ask of it), so this
module imports nothing of ``loader._loader``.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Protocol

from .errors import LoaderClosedError

if TYPE_CHECKING:
    from .run import Epoch, Run


class EpochOwner(Protocol):
    """What the iterator and the sampler ask of their loader."""

    @property
    def batch_size(self) -> int: ...

    @property
    def epoch(self) -> int: ...

    def set_epoch(self, epoch: int) -> None: ...

    def remaining(self) -> int: ...


class EpochIterator:
    """One epoch of a Loader. Obtained from ``iter(loader)``; started by its first ``next()``.

    ``len(iterator)`` is the number of batches it still yields. It keeps its loader alive (so
    ``iter(Loader(...))`` alone is enough) and asks the loader's run for each batch; it also
    shows accelerate's ``end_of_dataloader`` and ``remainder`` of its epoch.
    """

    def __init__(self, loader: EpochOwner, run: Run, epoch: Epoch) -> None:
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

    def __init__(self, loader: EpochOwner) -> None:
        self._loader = weakref.ref(loader)

    def _target(self) -> EpochOwner:
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
