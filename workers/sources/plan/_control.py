"""The worker's control state for a ``sharded_source``/``sharded_files`` root. Runs in the worker.

A :class:`~._sampling.BatchedSamples` is the user's object and holds the user's state (the
shard, ``load``, the sampling, the epoch it is at). What the worker decides about its samples, and
what it must remember of the batches in flight, lives here; the worker makes these objects and
hands them to the source with ``BatchedSamples.bind``:

* :class:`SampleControl` -- one per worker process, for its whole life (it outlives rebuilt
  sources): ``on_error``, the sample ids known to fail, and where a failed ``load`` is reported.
* :class:`FeedState` -- one per built source (``Sources.feed``): a :class:`FedBatch` record per
  batch handed to DALI and not yet delivered, and whether one iteration runs every epoch in turn.
* :class:`OpenedOnce` -- what a source opened at the worker's start (tar shards, a Parquet
  plan), kept for the source built again with the same arguments.

Threads: a source loads samples on its prefetch thread; everything else runs on the worker's main
thread (DALI pulls the source there, and the control channel is read there). Both objects are
written by the main thread only. The prefetch thread only reads :attr:`SampleControl.bad`: a
frozenset that each write replaces whole (never changes in place), so no lock is needed.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from ._skips import LoadSkip

_T = TypeVar("_T")

#: While the worker calls ``source(shard)``: whether the loader skips what it cannot read
#: (``on_error="skip"``), so that a source may leave out a damaged part of its data (a tar shard
#: that is not whole) instead of failing the start. False outside a worker.
SKIP_DAMAGED: ContextVar[bool] = ContextVar("SKIP_DAMAGED", default=False)
#: While the worker calls ``source(shard)``: a token its pool's workers share (started
#: together), under which a source may share with them what each would ask the store for (a
#: listing). Empty outside a worker: nothing is shared.
STARTED_TOGETHER: ContextVar[str] = ContextVar("STARTED_TOGETHER", default="")
#: While the worker builds its sources: tells the trainer what a long part of the start does
#: (``report(doing, done, total, seconds)``, main thread only), so that the trainer's startup
#: wait counts the worker as alive (a scan of shards without an index is not a hang) and names
#: it if the worker falls silent. None outside a worker: nothing is told.
REPORT_PROGRESS: ContextVar[Callable[[str, int, int, float], None] | None] = ContextVar(
    "REPORT_PROGRESS", default=None
)

#: Told of a sample whose ``load`` raised under ``on_error="skip"``:
#: (epoch, step, sample name, its :class:`~._skips.LoadSkip`: id, reason, kind).
ReportSkipped = Callable[[int, int, str, "LoadSkip"], None]


class SampleControl:
    """The worker's decisions about samples, kept across rebuilt sources.

    ``bad``: sample ids known to fail (from the trainer at spawn, from its ``BadSamples``, and from
    this worker's own failed loads), replaced without loading under ``on_error="skip"``.
    ``report_skipped``: called for each sample whose ``load`` raised; None logs it instead.
    Written only on the thread that made it (the worker's main thread); ``bad`` may be read on any.
    """

    def __init__(
        self,
        on_error: str = "raise",
        bad: Iterable[int] = (),
        report_skipped: ReportSkipped | None = None,
    ) -> None:
        self.on_error = on_error
        self.report_skipped = report_skipped
        self._bad = frozenset(bad)
        self._writer = threading.get_ident()

    @property
    def skip(self) -> bool:
        """``on_error="skip"``: a failing sample is replaced, not raised."""
        return self.on_error == "skip"

    @property
    def bad(self) -> frozenset[int]:
        """The sample ids known to fail, as of now (a snapshot: later finds replace it)."""
        return self._bad

    def add_bad(self, ids: Iterable[int]) -> None:
        """Remember more failing samples; main thread only (the prefetch thread reads ``bad``)."""
        assert threading.get_ident() == self._writer, "bad samples written off the main thread"
        found = frozenset(ids) - self._bad
        if found:
            self._bad = self._bad | found


@dataclass(frozen=True, slots=True)
class FedBatch:
    """A batch handed to DALI: what the worker attaches to it when it is delivered, and what
    it was loaded without (for searching it, should it fail)."""

    epoch: int
    step: int
    padded: int  # trailing rows of padding
    replaced: tuple[int, ...] = ()  # rows filled with a repeat of a good sample (on_error="skip")
    skipped: tuple[int, ...] = ()  # the sample ids those rows would have held
    #: (member, rows) of the optional members its real rows were given the default of
    defaulted: tuple[tuple[str, int], ...] = ()


class FeedState:
    """One built source's batches in flight, and how its iteration runs; main thread only.

    ``continuous``: one iteration of the source runs every epoch in turn (set by the worker with
    :meth:`set_continuous` before it starts the capture loop; see ``BatchedSamples.__iter__``).
    :meth:`at_next_pull`: what to run when DALI next asks the source for a batch, once.
    """

    def __init__(self) -> None:
        self._continuous = False
        #: one record per batch handed to DALI and not yet delivered, oldest first
        self._fed: deque[FedBatch] = deque()
        self._at_next_pull: Callable[[], None] | None = None

    @property
    def continuous(self) -> bool:
        """Whether one iteration of the source runs every epoch in turn."""
        return self._continuous

    def set_continuous(self, continuous: bool) -> None:
        """How the next iteration of the source runs: every epoch in turn, or one epoch."""
        self._continuous = continuous

    def at_next_pull(self, call: Callable[[], None] | None) -> None:
        """Run ``call`` when DALI next asks the source for a batch, before the batch is made
        (once; None: nothing). The worker sends its traced epoch's signature so: DALI asks for
        the traced step's next batch once it has built the pipeline from the trace, before it
        runs it (and the batch after, its prefetch)."""
        self._at_next_pull = call

    def pulling(self) -> None:
        """DALI asks the source for a batch: run what :meth:`at_next_pull` set, once."""
        call, self._at_next_pull = self._at_next_pull, None
        if call is not None:
            call()

    def fed(self, batch: FedBatch) -> None:
        """The source handed ``batch`` to DALI."""
        self._fed.append(batch)

    def delivered(self) -> FedBatch | None:
        """The oldest batch handed to DALI, now delivered; None when none is recorded."""
        return self._fed.popleft() if self._fed else None

    def find(self, epoch: int, step: int) -> FedBatch | None:
        """The record of batch ``step`` of ``epoch``, while it is in flight."""
        return next((f for f in self._fed if (f.epoch, f.step) == (epoch, step)), None)


class OpenedOnce(Generic[_T]):
    """What a source opened, once per worker and arguments: the source built again with the
    same ones (a resume's seek to its saved position, an epoch left early) keeps what was opened
    at the worker's start (tar shards, a Parquet plan: the set the job's plan was made from),
    instead of reading the summary and listing again. What changed since is still named when it
    is read (identities are checked then). Outside a loader's worker (no
    :data:`STARTED_TOGETHER` token), and with storage options that do not serialize to JSON,
    it is opened every time. Holds the last one only."""

    def __init__(self) -> None:
        self._last: tuple[Hashable, _T] | None = None

    def get(
        self,
        arguments: tuple[Hashable, ...],
        storage_options: Mapping[str, Any] | None,
        open_it: Callable[[], _T],
    ) -> _T:
        """``open_it()``'s result for these ``arguments`` (and ``storage_options``, the
        worker's pool and ``on_error``): the one opened last when they are the same."""
        key: Hashable = None
        pool = STARTED_TOGETHER.get()
        if pool:
            try:
                options = json.dumps(storage_options, sort_keys=True)
            except (TypeError, ValueError):
                options = None
            if options is not None:
                key = (pool, options, SKIP_DAMAGED.get(), arguments)
        last = self._last
        if key is not None and last is not None and last[0] == key:
            return last[1]
        opened = open_it()
        self._last = None if key is None else (key, opened)
        return opened
