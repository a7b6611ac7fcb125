"""``Loader``: the user's iterable over batches made by worker processes. Runs in the trainer.

Order: within an epoch, batches come round-robin over workers (worker 0's first batch, worker 1's
first, ..., worker 0's second, ...), skipping workers whose shard has ended. The trainer always
waits for the specific worker whose turn it is, so the sequence depends only on the seed.

Epochs follow the conventions every trainer assumes (torch's ``DataLoader``, Lightning,
accelerate): ``len(loader)`` is the epoch's length; ``iter(loader)`` is lazy (nothing reaches a
worker until the first ``next()``, and an iterator thrown away changes nothing); an iterator that
has delivered its epoch's last batch is finished even if nobody calls ``next()`` again, so the
next ``iter(loader)`` goes on with the next epoch, which the workers already prefetch. Leaving an
epoch early and starting another aborts it everywhere first: every worker stops its loop,
rebuilds its source and feeders for the next epoch (so DALI re-traces), and acknowledges.
``set_epoch(e)`` (torch's ``DistributedSampler`` convention; Lightning calls it through
``loader.sampler``) makes the next epoch ``e``: when the workers are ready for another one, they
rebuild their sources at ``e``'s start (a seek) before it starts.

Lifetime: the loader owns its epochs' state (:mod:`loader.run._epochs`) and nothing it holds refers
back to it, so dropping the last reference closes it at once (its finalizer), iterated or not.

A facade: the parameters and the public methods, each delegating. What changes per epoch and
layout is the run's (:mod:`loader.run`, which says who may start or stop processes).
"""

from __future__ import annotations

import logging
import os
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from workers import Definition, Shard

from ._epochs import EpochIterator, EpochSampler
from .config import AutotuneReport, LoaderConfig
from .engine import LoaderStats, WorkerStats
from .errors import LoaderClosedError
from .observe import Diagnosis, diagnose, rank_path, trace_events, write_trace
from .run import Run

logger = logging.getLogger("loader")

__all__ = ["AutotuneReport", "Diagnosis", "Loader", "LoaderStats", "WorkerStats"]

#: Every Loader whose workers were started and that was not closed (weakly: a dropped loader
#: leaves it). The ``leak_check`` fixture reads it to find loaders left open by a test.
OPEN_LOADERS: weakref.WeakSet[Loader] = weakref.WeakSet()


class Loader:
    """Batches from ``num_workers`` worker processes, each running DALI capture over one shard.

    ``source`` is a dataset definition (``FilesDataset(root)``, ``TarsDataset(urls)``,
    ``SamplesDataset(total, load)``, ``MixDataset(sources, weights)``), opened in each worker with
    ``batch_size``, or a function ``source(shard)`` (runs in the worker, once) that returns a DALI
    reader, an ``ndd.ExternalSource`` or what a ``sharded_*`` function returns for that shard;
    ``step(*source_outputs, **feeders)`` is the loop body, traced by DALI on the first step and
    replayed after; it returns a dict, a tuple or one DALI batch. The functions must be
    module-level: workers are spawned and import them by name. Every setting is in
    ``loader.config`` (a frozen :class:`LoaderConfig`, rank, world size and threads settled).

    The keywords are declared once, as :class:`LoaderConfig`'s fields (default and check side
    by side); this signature spells them again for IDEs and ``help()``, and a unit test keeps
    the two equal. docs/reference.md describes each. Rarely needed (defaults that suit almost
    every job): ``device_id`` (the GPU; by default the local rank's), ``startup_timeout``
    (seconds a starting worker may stay silent), ``shm_limit`` (a cap on each worker's shared
    memory) and ``max_skipped`` (the skip budget of ``on_error="skip"``).
    """

    def __init__(
        self,
        source: Definition | Callable[[Shard], Any],
        step: Callable[..., Any],
        *,
        batch_size: int,
        num_workers: int | str = 2,
        feeders: Callable[[Shard], Mapping[str, Any]] | None = None,
        device: str = "cpu",
        device_id: int | None = None,
        num_threads: int | str | None = None,
        prefetch: int = 2,
        output: str = "numpy",
        copy: bool = False,
        capture: bool = True,
        seed: int = 0,
        timeout: float | None = None,
        start_method: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        startup_timeout: float = 300.0,
        shm_limit: int | None = None,
        max_restarts: int = 0,
        on_error: str = "raise",
        max_skipped: int | None = None,
        in_order: bool = True,
        cut_padding: bool = False,
        cut_replaced: bool = True,
        trace: str | os.PathLike[str] | None = None,
        memory_limit: int | float | None = None,
    ) -> None:
        # the parameters, as given: LoaderConfig's fields declare each (its default, its check)
        # and a unit test keeps this signature equal to them
        given = dict(locals())
        del given["self"]
        self._run: Run | None = None  # until it exists, close() has nothing to do
        self._closed = True
        config = LoaderConfig.build(**given)
        run = Run(config)  # its first workers started (closed again if they do not start)
        self._run, self._closed = run, False
        self._sampler = EpochSampler(self)  # (it refers to this loader weakly)
        # the run refers to nothing of the loader's: dropping the loader closes it at once
        self._finalizer = weakref.finalize(self, run.close)
        OPEN_LOADERS.add(self)

    @property
    def config(self) -> LoaderConfig:
        """Every setting, validated, as the next epoch runs them: the rank a process group
        settled and the layout ``num_workers="auto"`` chose apply when that epoch starts, and
        show here at once (the running workers are ``worker_pids()``)."""
        run = self._run
        assert run is not None
        return run.layout.config if self._closed else run.planned(strict=False)

    @property
    def batch_size(self) -> int:
        """Samples per batch (as torch's ``DataLoader.batch_size``)."""
        return self.config.batch_size

    @property
    def num_workers(self) -> int:
        """Workers of this rank (as torch's ``DataLoader.num_workers``)."""
        return self.config.num_workers

    @property
    def dataset_size(self) -> int:
        """The real samples of an epoch over every rank (padding not counted). A query."""
        return self._require().sampling().total

    # ------------------------------------------------------------------------------ epochs
    @property
    def epoch(self) -> int:
        """The epoch the next ``iter(loader)`` runs."""
        return self._require().epoch

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter(loader)`` run ``epoch``: its order, and ``batch.info.epoch``
        (the convention of torch's ``DistributedSampler``, which Lightning follows at every
        epoch's start through ``loader.sampler``). The epoch the next ``iter()`` runs anyway
        costs nothing; another moves the workers to ``epoch``'s start when that epoch starts
        (they rebuild their sources for it). An epoch half-delivered now goes on until the next
        ``iter()``, which ends it early as always. A state loaded with :meth:`load_state_dict`
        is kept for its own epoch, and dropped (with a logged warning) for another."""
        self._require().set_epoch(epoch)

    @property
    def sampler(self) -> EpochSampler:
        """What a trainer calls ``set_epoch`` on at each epoch's start (Lightning does):
        ``loader.sampler.set_epoch(e)`` is :meth:`set_epoch`. Not a torch ``Sampler``, so
        Lightning does not take the loader for a ``DataLoader`` to re-make."""
        return self._sampler

    @property
    def batch_sampler(self) -> EpochSampler:
        """The same object as :attr:`sampler` (with ``batch_size``), for code that looks for a
        sampler through a ``DataLoader``'s ``batch_sampler``."""
        return self._sampler

    def __iter__(self) -> Iterator[Any]:
        """An iterator over the next epoch. Lazy: the epoch starts at its first ``next()`` (the
        only moment, with ``close()``, that workers are started, stopped or replaced: a layout
        of ``num_workers="auto"``, a rank a process group settled, a loaded state), so an
        iterator thrown away (Lightning makes one to check the loader) changes nothing.
        Starting another while an epoch is half-delivered ends that epoch early everywhere."""
        run = self._require()
        return EpochIterator(self, run, run.open_epoch())

    def __len__(self) -> int:
        """Batches this rank gets per epoch, the same on every rank (known for
        :func:`sharded_source`, :func:`sharded_files` and readers that stick to their shard).

        As for torch's ``DataLoader``, it is the epoch's length even in an epoch resumed by
        :meth:`load_state_dict`: the batches this rank had received before the save plus those
        left, which the resumed iterator yields (a trainer that restores its own count of
        batches done stops after ``len()`` exactly). Resumed on another layout, it is at least
        the new layout's epoch length (the iterator then ends before ``len()``, as a trainer
        expects of a shorter epoch). :meth:`remaining` gives the batches left. A query: it
        computes the next epoch's layout and never starts or waits on a worker.
        """
        return self._require().length()

    def remaining(self) -> int:
        """Batches still to come in the epoch in progress (between epochs: in the next one,
        which is shorter than ``len()`` after :meth:`load_state_dict`). A query."""
        return self._require().remaining()

    def state_dict(self) -> dict[str, Any]:
        """Where the loader stands: a small JSON-serialisable dict (O(shards)) to save with a
        checkpoint and give to :meth:`load_state_dict`.

        It counts, per global shard, the batches the trainer has received (handed out by the
        iterator; prefetched ones do not count) in the epoch in progress, and keeps the DALI
        random generator states of each shard's first batch not received, so that a resume on
        the same layout gives the same bytes; once an epoch's last batch was handed out, it
        describes the next epoch with nothing received (whether or not ``next()`` was called
        again). With a ``torch.distributed`` group up it is a collective (every rank gets the
        same global dict); without one it describes this rank's shards. A query: no message to
        the workers. Needs :func:`sharded_source` or :func:`sharded_files` (or their kin).
        It stays valid after a Ctrl-C (``KeyboardInterrupt``) anywhere in the loop, even one that
        stopped the workers (docs/checkpointing.md, "Interrupted: Ctrl-C").
        """
        return self._require(interrupted=True).state()

    def load_state_dict(self, state: Mapping[str, Any], *, strict: bool = True) -> None:
        """Continue from a state of :meth:`state_dict`, on this or another layout.

        It checks the state and keeps it: the next epoch's start (the first ``next()``)
        applies it, continuing that epoch at the first batch not yet received (no batch before
        it is read); later epochs run as if there had been no interruption. On the same world
        size and workers the batches are byte-identical to the uninterrupted run's, DALI's
        random draws included (the workers restore their random generators; see the docs for
        which pipelines); on another layout the samples not yet received are split among the
        new shards (padding flagged), every rank the same number of steps, and the random
        draws start afresh (logged). A state that cannot apply (another dataset size or
        fingerprint, seed or batch size, a newer format) raises ``ValueError`` naming the
        field, before any worker does anything; ``strict=False`` resumes over a dataset whose
        fingerprint differs with a warning instead. An epoch half-delivered now is left: its
        iterator ends, and the next ``iter()`` stops it in the workers.
        """
        self._require().load(state, strict=strict)

    # ------------------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Stop every worker and release all shared memory (first, with ``trace=``, write the
        trace). Idempotent; bounded in time."""
        run = self._run
        trace = None if run is None else run.layout.config.trace
        if not self._closed and trace is not None:
            try:
                self.save_trace(trace)
            except (OSError, LoaderClosedError) as error:
                warnings.warn(f"the trace was not written: {error}", RuntimeWarning, stacklevel=2)
        self._closed = True
        OPEN_LOADERS.discard(self)
        if run is not None:
            self._finalizer()

    def __reduce__(self) -> Any:
        raise TypeError(
            "a Loader cannot be sent to another process (pickled): it owns this process's "
            "workers. Build it in the process that iterates it: under Lightning's "
            "strategy='ddp_spawn' (which pickles the LightningModule and DataModule into each "
            "rank), in train_dataloader(), or use strategy='ddp'"
        )

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed or self._run is None or self._run.closed

    def worker_pids(self) -> list[int]:
        return self._require().pids()

    # ------------------------------------------------------------------------------ observe
    def stats(self, window: float = 10.0) -> LoaderStats:
        """A snapshot of per-worker and trainer-side counters: totals since the start, and the
        stage times of the last ``window`` seconds up to the latest ``next()`` (``recent``,
        ``recent_trainer``, over ``window_seconds``)."""
        if isinstance(window, bool) or not isinstance(window, (int, float)) or not window > 0:
            raise ValueError(f"window must be a positive number of seconds, got {window!r}")
        run = self._run
        assert run is not None
        return run.stats(float(window))

    def diagnose(self, window: float = 30.0) -> Diagnosis:
        """Is the input pipeline the bottleneck? Over the last ``window`` seconds of iteration
        (the traced first batch left out): the loop's time waiting for data, the workers'
        dominant stage, whether they are CPU-saturated, waiting on I/O or blocked on full slots,
        and one suggestion with its figure (``print(loader.diagnose())``). No message to the
        workers. With a ``torch.distributed`` group up a collective: call it on every rank
        (the shared settings are advised from every rank's figures; docs/diagnosis.md)."""
        run = self._run
        assert run is not None
        config = run.layout.config
        return diagnose(
            self.stats(window),
            num_threads=config.num_threads,
            prefetch=config.prefetch,
            in_order=config.in_order,
            config=config,
            fingerprint=run.fingerprint(),
        )

    def save_trace(self, path: str | os.PathLike[str], seconds: float = 60.0) -> Path:
        """Write the last ``seconds`` of per-worker and trainer spans (the last 8,192 batches
        of each worker at most) to ``path`` as Chrome trace-event JSON (Perfetto); returns the
        path. Per rank: ``{rank}`` in the name, else ``trace.json`` -> ``trace.rank1.json``."""
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
            raise ValueError(f"seconds must be a positive number, got {seconds!r}")
        run = self._run
        names = None if run is None else run.worker_names()
        if run is None or names is None:
            raise LoaderClosedError("the loader never started: there is nothing to trace")
        config = run.layout.config
        trace = trace_events(
            run.timeline,
            float(seconds),
            names,
            pid=os.getpid(),
            name=f"dali-capture-loader, rank {config.rank} of {config.world_size}",
        )
        return write_trace(rank_path(path, config.rank, config.world_size), trace)

    def _require(self, *, interrupted: bool = False) -> Run:
        run = self._run
        if run is None or self._closed:
            raise LoaderClosedError("the loader is closed")
        run.require(interrupted=interrupted)
        return run
