"""The run's lifecycle: what changes per epoch and per layout.

Owns: the :class:`~loader.run._run.Run` (the epoch being delivered, and the one ``Progress`` a
state encodes), its :class:`~loader.run._launcher.Launcher` (the pool and coordinator of the
current layout: the only object that starts or replaces them), the epoch it shares with the
user's iterator (:mod:`._epochs`; the iterator and the sampler are the face's,
:mod:`loader._epochs`), the state's encoding (:mod:`._checkpoint`), the agreement across ranks
(:mod:`._ranks`) and the measurements that ``num_workers="auto"`` decides on (:mod:`._tuning`).
Only ``iter()`` and ``close()`` reach it to start, stop or replace processes.

May import: ``loader.errors``, :mod:`loader.config`, :mod:`loader.processes`,
:mod:`loader.engine`, ``workers``, ``ipc``.
"""

from ._epochs import Epoch
from ._run import Run

__all__ = [
    "Epoch",
    "Run",
]
