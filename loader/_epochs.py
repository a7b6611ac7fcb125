"""One epoch of a Loader as the user iterates it, and accelerate's dataloader protocol.
Runs in the trainer."""

from __future__ import annotations

import contextlib
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._loader import Loader


class EpochIterator:
    """One epoch of a Loader. Obtained from ``iter(loader)``; started by its first ``next()``.

    ``len(iterator)`` is the number of batches it still yields. It also speaks accelerate's
    dataloader protocol (``end_of_dataloader``, ``remainder``): under an ``Accelerator`` with
    gradient accumulation, gradients are synchronised at the epoch's last batch.
    """

    def __init__(self, loader: Loader, epoch: int) -> None:
        self._loader = loader
        self.epoch = epoch  # settled when it starts
        self.started = False
        self.finished = False
        self.replaced = False
        self.delivered = 0  # batches handed out by this iterator
        self.expected: int | None = None  # batches it hands out in all, when known
        self.end_of_dataloader = False  # accelerate: the last batch was handed out
        self.remainder = -1  # accelerate: no samples of the last batch are duplicates to drop
        self.accelerate: Any = None  # accelerate's GradientState, while registered with it

    def __iter__(self) -> EpochIterator:
        return self

    def __next__(self) -> Any:
        return self._loader._next(self)

    def __len__(self) -> int:
        if self.finished or self.replaced:
            return 0
        if self.started:
            if self.expected is None:
                raise TypeError("the length of this epoch is unknown for this source")
            return self.expected - self.delivered
        return self._loader.remaining()

    @property
    def in_progress(self) -> bool:
        return self.started and not self.finished

    def handed_out(self) -> None:
        """One more batch; the epoch's last one ends it now, not at a ``next()`` that a trainer
        stopping after ``len()`` batches never makes."""
        self.delivered += 1
        if self.expected is not None and self.delivered >= self.expected:
            self.finished = True
            self.end_of_dataloader = True

    def join_accelerate(self) -> None:
        """Register with accelerate's ``GradientState`` when an ``Accelerator`` exists in this
        process (nothing of accelerate is imported or created here)."""
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
