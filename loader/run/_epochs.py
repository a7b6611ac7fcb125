"""One epoch of a Loader: what the run and the iterator the user holds share, and accelerate's
dataloader protocol. Runs in the trainer.

An :class:`Epoch` refers to nothing of the run's or the loader's: the run owns the newest one,
the user's iterator (:mod:`loader._epochs`) shares it, and accelerate's ``GradientState`` refers to
it weakly.
"""

from __future__ import annotations

import contextlib
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._checkpoint import Resume


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
