"""Exactly-once sharding and full batches for ExternalSource roots. Runs in the worker.

DALI refuses a short batch from an ExternalSource root (``Expected batch size B, got n``), and a
reader's own ``pad_last_batch``/``stick_to_shard`` rules decide which samples an epoch holds. The
helpers here let the loader decide instead, deterministically from the seed and the epoch
(:mod:`workers.sources.plan._positions` does the arithmetic):

* :class:`BatchedSamples` turns a shard's part of each epoch into full batches of ``batch_size``
  and records, per batch yielded, how many rows are padding; the worker attaches that count to
  the delivered batch (``info.padded``). Built for a shard that carries a saved position, its
  first epoch starts where that position stopped (nothing before it is loaded).
* A dataset definition (:mod:`sources._datasets`) opens into one, for the loader's batch size;
  :func:`sharded_source` and its kin return one from ``source(shard)``. Either way the worker
  puts it under DALI (an ``ndd.ExternalSource`` root it makes itself): the batches here are
  numpy arrays, and nothing here imports DALI.

A :class:`BatchedSamples` holds the user's state only. The worker's control state (``on_error``,
the samples known to fail, the records of batches in flight, whether one iteration runs every
epoch) is owned by the worker (:mod:`workers.sources.plan._control`) and handed over with
:meth:`BatchedSamples.bind`; unbound, it loads every sample, raises when a ``load`` raises and runs
one epoch per iteration.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from ipc.wire import LoadRunning, Sampling

from ...spec import Shard, attach
from ._control import FedBatch, FeedState, SampleControl
from ._positions import Batch, Orders, shard_batches, shard_steps
from ._skips import LoadSkip, load_skip

logger = logging.getLogger("workers")

#: Batches whose arrays a source keeps referenced after yielding them.
_KEEP_ALIVE = 4
#: The epochs whose plan of batches is kept (this one and the next).
_PLANS_KEPT = 2
#: Samples of later batches tried for a stand-in when every sample of a batch failed.
_STAND_IN_TRIES = 256

#: Largest sample (bytes) that is stacked with the rest of its batch into one dense array.
_STACK_BYTES = 1024


@dataclass(frozen=True, slots=True)
class Batching:
    """How a shard's samples become batches: the options of every ``sharded_*`` function and of
    a dataset's ``source``, declared once here. Their public signatures name each of these
    fields, with its default; their bodies pass them on as one object (:meth:`pick`), down to
    :class:`BatchedSamples`. A new option: a field here, and a keyword in those signatures."""

    batch_size: int
    shuffle: bool = True
    drop_last: bool = False

    @classmethod
    def pick(cls, arguments: Mapping[str, Any]) -> Batching:
        """The options among a function's ``arguments`` (its ``locals()``), by their names."""
        return cls(**{option.name: arguments[option.name] for option in fields(cls)})


class BatchedSamples:
    """Re-iterable: each ``iter()`` is one epoch of full batches over this shard's samples.

    ``load(index)`` returns one sample (an array) or a tuple of ``num_outputs`` arrays; with
    ``pass_epoch=True`` it is called as ``load(index, epoch)``, the epoch the sample is loaded
    for. ``fingerprint``: what the samples are (saved in a state, checked when it is loaded);
    ``parts``: what they are part by part (:mod:`sources.plan._parts`: a refused state names the
    parts that differ).
    ``orders``: the source's own epoch orders (see :data:`sources.plan._positions.Orders`), else the
    seeded permutation of ``[0, total)``. ``batching``: :class:`Batching`, or a batch size and
    the other options of :class:`Batching` by name (``BatchedSamples(shard, 16, load, 4,
    drop_last=True)``).

    A ``load`` that reads ahead (tar shards in an object store) is told what is coming: when it
    has an ``expect(epoch, ids)`` method, that is called with the sample ids of every batch of an
    epoch (in order) before the epoch's first load, and ``passed(epoch, step)`` once batch
    ``step`` is loaded (what only earlier batches needed can go).
    """

    def __init__(
        self,
        shard: Shard,
        total: int,
        load: Callable[..., Any],
        batching: Batching | int,
        *,
        num_outputs: int = 1,
        fingerprint: str = "",
        pass_epoch: bool = False,
        orders: Orders | None = None,
        parts: str = "",
        left_out: tuple[str, ...] = (),
        **options: Any,
    ) -> None:
        if not isinstance(batching, Batching):
            batching = Batching(batching, **options)
        elif options:
            raise TypeError(f"options {sorted(options)} given besides a Batching")
        batch_size = batching.batch_size
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if isinstance(total, bool) or not isinstance(total, int) or total < 1:
            raise ValueError(f"total must be a positive number of samples, got {total!r}")
        self.shard = shard
        self.load = load
        self.pass_epoch = pass_epoch
        self.num_outputs = num_outputs
        self.orders = orders
        self.batching = batching
        #: what the source leaves out of every epoch (``wire.Hello.left_out``)
        self.left_out = left_out
        # the loader's seed: the same on every shard (a shard's own seed is seed + index)
        seed = shard.seed - shard.index
        self.sampling = Sampling(
            total, batch_size, seed, batching.shuffle, batching.drop_last, fingerprint, parts
        )
        self.epoch = shard.epoch
        self.position = shard.position
        self._plans: OrderedDict[int, list[Batch]] = OrderedDict()  # (see batches_for_epoch)
        # the worker's, handed over by ``bind``; until then, a control state of its own
        self._control = SampleControl()
        self._feed = FeedState()
        #: the last sample loaded whole: fills the rows of a batch none of whose samples load
        self._last_good: Any = None
        #: the load running now: (sample id, time.monotonic() at its start; written by the
        #: thread that loads), and the batch (epoch, step) loaded last or now (written by the
        #: main thread); read when the trainer asks a stuck worker for its stack
        self.loading: tuple[int, float] | None = None
        self.loading_batch: tuple[int, int] = (-1, -1)
        #: for the worker's per-stage timing (ns, running totals): the main thread's waits for a
        #: batch's samples, and the prefetch thread's wall and CPU time in ``load_batch``
        self.wait_ns = 0
        self.load_ns = 0
        self.load_cpu_ns = 0
        #: batches of this shard in a whole epoch (a worker may have one more than another)
        self.steps = shard_steps(
            total, shard.index, shard.count, batch_size, batching.drop_last, shard.world_size
        )
        #: batches of the first epoch these sources run (fewer when resumed mid-epoch)
        self.first_epoch_steps = len(self.batches_for_epoch(self.epoch))

    def bind(self, control: SampleControl, feed: FeedState) -> None:
        """Take the worker's control state (before the first epoch): ``control`` decides how
        failing samples are handled, ``feed`` records the batches handed to DALI."""
        self._control = control
        self._feed = feed

    @property
    def total(self) -> int:
        return self.sampling.total

    @property
    def batch_size(self) -> int:
        return self.sampling.batch_size

    def __len__(self) -> int:
        return self.steps

    def batches_for_epoch(self, epoch: int) -> list[Batch]:
        """(indices, padded rows) of every batch of ``epoch`` this shard yields: planned once
        (it is asked for at the start, when the epoch runs and by the worker's records of it)
        and kept for the last two epochs, so the same list each time: not to be changed."""
        plan = self._plans.get(epoch)
        if plan is None:
            shard = self.shard
            plan = shard_batches(
                self.sampling,
                epoch,
                shard.index,
                shard.count,
                self.position,
                self.orders,
                ranks=shard.world_size,
            )
            self._plans[epoch] = plan
            while len(self._plans) > _PLANS_KEPT:
                self._plans.popitem(last=False)
        return plan

    def load_sample(self, index: int, epoch: int) -> Any:
        """Sample ``index`` as loaded for ``epoch``: ``load(index)``, or ``load(index, epoch)``."""
        return self.load(index, epoch) if self.pass_epoch else self.load(index)

    def _load(self, index: int, epoch: int) -> Any:
        """:meth:`load_sample`; an exception leaves with the phase and the sample id in its
        context (:mod:`workers.spec._error_context`)."""
        self.loading = (index, time.monotonic())
        try:
            return self.load_sample(index, epoch)
        except Exception as error:
            attach(error, phase=f"load, sample {index}")
            raise
        finally:
            self.loading = None

    def load_in_progress(self) -> LoadRunning | None:
        """The sample whose ``load`` runs now (on the prefetch thread), and for how long; None
        when none runs."""
        loading = self.loading
        if loading is None:
            return None
        index, started = loading
        try:
            name = self.name(index)
        except Exception:
            name = str(index)
        epoch, step = self.loading_batch
        return LoadRunning(index, time.monotonic() - started, name, epoch, step)

    def name(self, index: int) -> str:
        """A sample's name: a file's path for sharded_files, else its id."""
        name = getattr(self.load, "describe", None)
        return str(index) if name is None else str(name(index))

    def describe(self, index: int) -> str:
        """How a sample is named in logs and errors: its id, and its file for sharded_files."""
        name = self.name(index)
        return f"sample {index}" if name == str(index) else f"sample {index} ({name})"

    def _timed_load_batch(self, chunk: np.ndarray[Any, Any], epoch: int) -> LoadedSamples:
        """:meth:`load_batch`, its wall and CPU time added to ``load_ns`` and ``load_cpu_ns``
        (on the prefetch thread, their only writer)."""
        wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
        try:
            return self.load_batch(chunk, epoch)
        finally:
            self.load_cpu_ns += time.thread_time_ns() - cpu
            self.load_ns += time.perf_counter_ns() - wall

    def load_batch(self, chunk: np.ndarray[Any, Any], epoch: int) -> LoadedSamples:
        """Every sample of a batch of ``epoch``; with ``on_error="skip"`` a sample whose
        ``load`` raises (or that is known bad) is replaced by a repeat of a good sample of the
        same batch (of an earlier batch when none of this one loads): the row is flagged
        (``info.replaced``) and, like padding, cut with ``cut_padding=True``. A skipped sample
        is not filled with one of a later batch: the positions (a count of batches per shard)
        stay the same whatever is skipped, so a resume on any layout stays exactly once.
        May run on the prefetch thread: it writes no shared state and reports nothing itself
        (the caller does both from ``LoadedSamples.errors``)."""
        ids = [int(index) for index in chunk]
        if not self._control.skip:
            return LoadedSamples([self._load(index, epoch) for index in ids])
        samples: list[Any] = []
        failed: list[int] = []
        errors: list[LoadSkip] = []
        raised: set[int] = set()  # ids whose load raised in this batch (one may repeat)
        for row, index in enumerate(ids):
            if index in raised or index in self._control.bad:
                samples.append(None)
                failed.append(row)
                continue
            try:
                samples.append(self._load(index, epoch))
            except Exception as error:
                if getattr(error, "_loader_fatal", False):  # storage, not the sample: stop
                    raise
                raised.add(index)
                errors.append(load_skip(index, error))
                samples.append(None)
                failed.append(row)
        good = next((sample for sample in samples if sample is not None), None)
        if good is not None:  # (the prefetch thread's alone: one load_batch at a time)
            self._last_good = good
        if not failed:
            return LoadedSamples(samples)
        if good is None:  # (a damaged part of the data: a row group, a shard's tail)
            good = (
                self._last_good
                if self._last_good is not None
                else self._stand_in(epoch, ids, raised)
            )
        if good is None:
            distinct = list(dict.fromkeys(ids))
            named = ", ".join(self.describe(i) for i in distinct[:4])
            raise _no_stand_in(
                f"every sample of a batch failed to load ({named}"
                f"{', ...' if len(distinct) > 4 else ''}; first: "
                f"{errors[0].reason if errors else 'known bad'}), and no other sample of the "
                f"dataset loaded to fill their rows (up to {_STAND_IN_TRIES} tried): the data "
                "is at fault, not the step. Check that the data is readable and that "
                "ext=/columns= name what the samples hold (optional= for a member some samples "
                "lack)"
            )
        for row in failed:
            samples[row] = good
        skipped = tuple(dict.fromkeys(ids[row] for row in failed))
        return LoadedSamples(samples, tuple(failed), skipped, errors)

    def _stand_in(self, epoch: int, ids: list[int], raised: set[int]) -> Any | None:
        """A good sample to stand in a batch whose every sample failed under skip (all of them
        in one damaged part: a row group, a shard cut short): the last good sample loaded, else
        the first that loads of this shard's batches of ``epoch``, else of the whole dataset's
        samples (a shard whose whole part is damaged: a small dataset's one row group); it is
        still delivered in its own batch, here its rows are flagged replaced. None when none
        loads."""
        own = (int(i) for chunk, _pad in self.batches_for_epoch(epoch) for i in chunk)
        stride = max(1, self.total // _STAND_IN_TRIES)  # (spread over the dataset's parts)
        others = (i for start in range(stride) for i in range(start, self.total, stride))
        candidates = itertools.chain(own, others)
        tried = 0
        for index in candidates:
            if index in ids or index in raised or index in self._control.bad:
                continue
            tried += 1
            try:
                sample = self._load(index, epoch)
                self._last_good = sample
                return sample
            except Exception as error:
                if getattr(error, "_loader_fatal", False):
                    raise
                if tried >= _STAND_IN_TRIES:
                    return None
                raised.add(index)  # (its own batch finds it again: skipped there)
        return None

    def __iter__(self) -> Iterator[Any]:
        """One epoch of batches; when the worker's feed state is ``continuous``, every epoch
        after it too, in order (the worker then counts each epoch's steps itself, and DALI's
        prefetch runs on into the next epoch while the last batches of this one are delivered,
        as it does for a reader)."""
        while True:
            epoch = self.epoch
            self.epoch += 1
            batches = self.batches_for_epoch(epoch)
            yield from self._epoch(epoch, batches)
            if not self._feed.continuous or (not batches and self.steps == 0):
                return

    def epoch_steps(self, epoch: int) -> int:
        """Batches of ``epoch`` (fewer in the epoch of a saved position)."""
        return self.first_epoch_steps if epoch == self.shard.epoch else self.steps

    def batch_at(self, epoch: int, step: int) -> tuple[list[int], frozenset[int]] | None:
        """The sample ids of batch ``step`` of ``epoch``, and those of them it was loaded
        without (replaced as known bad: they cannot have broken it). A step past the epoch's
        end is in the next one when the batches are continuous. None past the last batch."""
        batches = self.batches_for_epoch(epoch)
        if step >= len(batches) and self._feed.continuous:
            step -= len(batches)
            epoch += 1
            batches = self.batches_for_epoch(epoch)
        if step >= len(batches):
            return None
        # ``bad`` grows while batches are in flight (another worker's finds arrive any time):
        # what a batch was loaded without is in its record, until the batch is delivered
        fed = self._feed.find(epoch, step)
        replaced = self._control.bad if fed is None else frozenset(fed.skipped)
        return [int(index) for index in batches[step][0]], replaced

    def _epoch(self, epoch: int, batches: list[Batch]) -> Iterator[Any]:
        """The batches of one epoch. Batch k+1's samples are loaded on a prefetch thread while
        DALI works on batch k (file reads release the GIL), so I/O overlaps decoding.

        Each batch is numpy: per output, a list of the samples' arrays or one array of small
        samples stacked (:func:`_batch_arrays`); a tuple of those with several outputs. The
        worker's DALI adapter (``workers.dali.batches_root``) wraps them without copying. DALI
        copies a fed batch into its own buffers; the last few are kept alive here all the same.
        """
        if not batches:
            return
        alive: deque[list[Any]] = deque(maxlen=_KEEP_ALIVE)
        expect = getattr(self.load, "expect", None)
        passed = getattr(self.load, "passed", None)
        if expect is not None:
            expect(epoch, [chunk for chunk, _pad in batches])
        with ThreadPoolExecutor(1, thread_name_prefix="sample-prefetch") as prefetch:
            self.loading_batch = (epoch, 0)
            load = self._timed_load_batch
            pending: Future[LoadedSamples] = prefetch.submit(load, batches[0][0], epoch)
            for step, (_chunk, pad_rows) in enumerate(batches):
                self._feed.pulling()  # (DALI asks for this batch now)
                waited = time.perf_counter_ns()
                loaded = pending.result()
                self.wait_ns += time.perf_counter_ns() - waited
                if passed is not None:
                    passed(epoch, step)
                if loaded.errors:  # remembered here (main thread) before the next batch loads
                    self._control.add_bad(skip.index for skip in loaded.errors)
                if step + 1 < len(batches):
                    self.loading_batch = (epoch, step + 1)  # (one load_batch at a time)
                    pending = prefetch.submit(load, batches[step + 1][0], epoch)
                for skip in loaded.errors:
                    self._skipped_on_load(epoch, step, skip)
                defaulted = _defaulted(loaded.samples, pad_rows, loaded.replaced)
                self._feed.fed(
                    FedBatch(epoch, step, pad_rows, loaded.replaced, loaded.skipped, defaulted)
                )
                samples = loaded.samples
                outputs = [
                    _batch_arrays(
                        [
                            np.ascontiguousarray(_output(sample, k, self.num_outputs))
                            for sample in samples
                        ]
                    )
                    for k in range(self.num_outputs)
                ]
                alive.append(outputs)
                yield outputs[0] if self.num_outputs == 1 else tuple(outputs)

    def _skipped_on_load(self, epoch: int, step: int, skip: LoadSkip) -> None:
        """A sample whose ``load`` raised was left out of batch ``step`` of ``epoch``: the
        worker tells the trainer (which logs it once for all workers, and tells the others);
        without a worker, it is logged here."""
        report = self._control.report_skipped
        if report is not None:
            report(epoch, step, self.name(skip.index), skip)
        else:
            logger.warning("skipped %s: %s", self.describe(skip.index), skip.reason)


def _output(sample: Any, k: int, num_outputs: int) -> Any:
    """Output ``k`` of a loaded sample: with one output, the sample itself, or the one array of
    a tuple of one (a reader of one column or member returns its outputs as a tuple, as with
    several: without this the array gained a leading dimension of 1)."""
    if num_outputs != 1:
        if not isinstance(sample, (tuple, list)) or len(sample) != num_outputs:
            given = (
                f"a {type(sample).__name__} of {len(sample)}"
                if isinstance(sample, (tuple, list))
                else f"one {type(sample).__name__}"
            )
            raise TypeError(
                f"load returned {given} for num_outputs={num_outputs}: return a tuple of "
                f"{num_outputs} arrays, one per output"
            )
        return sample[k]
    return sample[0] if isinstance(sample, tuple) and len(sample) == 1 else sample


class Defaulted(tuple[Any, ...]):
    """A sample (its outputs) that lacked optional ``members`` and holds their defaults: a
    ``load`` returns one so that the loader counts them (``stats().defaulted``)."""

    members: tuple[str, ...]

    def __new__(cls, outputs: Any, members: Any) -> Defaulted:
        made = super().__new__(cls, outputs)
        made.members = tuple(members)
        return made

    def __reduce__(self) -> Any:
        return (Defaulted, (tuple(self), self.members))


def _defaulted(
    samples: list[Any], pad_rows: int, replaced: tuple[int, ...]
) -> tuple[tuple[str, int], ...]:
    """(member, rows) of the optional members the batch's real rows (not padding, not
    replaced) were given the default of."""
    counts: dict[str, int] = {}
    gone = set(replaced)
    for row in range(len(samples) - pad_rows):
        members = getattr(samples[row], "members", None)
        if members and row not in gone:
            for member in members:
                counts[member] = counts.get(member, 0) + 1
    return tuple(sorted(counts.items()))


def _batch_arrays(
    arrays: list[np.ndarray[Any, Any]],
) -> list[np.ndarray[Any, Any]] | np.ndarray[Any, Any]:
    """Small samples of one shape and dtype (labels, ids) stacked into one array: DALI wraps a
    list sample by sample (about 1.4 us each, 90 us for a batch of 64 labels) but a dense array
    at once (17 us). Large or ragged samples stay a list of views (stacking would copy them)."""
    first = arrays[0]
    if first.nbytes > _STACK_BYTES:
        return arrays
    shape, dtype = first.shape, first.dtype
    for array in arrays:
        if array.shape != shape or array.dtype != dtype:
            return arrays
    return np.stack(arrays)


@dataclass
class LoadedSamples:
    """One batch's samples as loaded; ``errors``: the skip of each sample whose ``load``
    raised, to remember and report on the main thread."""

    samples: list[Any]
    replaced: tuple[int, ...] = ()
    skipped: tuple[int, ...] = ()
    errors: list[LoadSkip] = field(default_factory=list)


@dataclass
class OpenedSource:
    """A dataset opened in a worker: its size, how to load a sample, what it is."""

    total: int
    load: Callable[[int], Any]
    num_outputs: int
    fingerprint: str
    #: names of the outputs, when the dataset has them (``("jpg", "cls")``)
    names: tuple[str, ...] | None = None
    #: the dataset's own orders (a permutation per epoch, or per turn of its stream); None: a
    #: seeded permutation of ``[0, total)``
    orders: Orders | None = None
    describe: Callable[[int], str] | None = None
    #: ``load`` is called as ``load(index, epoch)``
    pass_epoch: bool = False
    #: what the dataset is, part by part (:mod:`sources.plan._parts`; empty: not known)
    parts: str = ""
    #: what it leaves out of every epoch, one line each (see ``wire.Hello.left_out``)
    left_out: tuple[str, ...] = ()


def _no_stand_in(message: str) -> RuntimeError:
    """The error of a batch none of whose samples loads, with no good sample anywhere to fill
    its rows: the data's fault (``_loader_data_fault``: not searched for failing samples as a
    batch that fails in the step is)."""
    error = RuntimeError(message)
    error._loader_data_fault = True  # type: ignore[attr-defined]
    return error
