"""Isolating the samples that broke a batch. Runs in the worker, on its main thread.

A batch of a ``sharded_source``/``sharded_files`` root that failed inside DALI or ``step`` (a
failing ``load`` is already handled sample by sample), with no feeders, can be searched for the
samples that fail on their own (:func:`can_isolate`). :class:`FailingSamples` does the search and
decides what follows: with ``on_error="skip"`` the trainer is told which samples they are (it
starts a new worker at that batch with them replaced); otherwise the error is raised again, its
message naming them first (DALI names only the operator; see
:mod:`workers.spec._error_context`).

Method: each sample of the batch is loaded and run through ``step`` alone, eagerly (a batch of
one, in the worker's EvalContext): it costs one re-run of the batch's samples. What native code
logs during the re-run repeats what the failed batch already printed: it is kept for the error,
not printed again (:mod:`workers.capture._stderr`); what the failed batch printed of them is
held back and dropped when the samples are skipped (:mod:`workers.capture._native_lines`).
"""

from __future__ import annotations

import logging
from typing import Any

from ipc import wire

from .. import dali
from ..sources import BatchedSamples
from ..spec import WorkerSpec
from ..transport import (
    attach,
    context_of,
    every_sample_fails,
    failed_in_decoder,
    normalize_outputs,
    short_reason,
)
from ..transport import message as failure_message
from . import _stderr
from ._phase import Phase
from ._sources import Sources

logger = logging.getLogger("workers")


def can_isolate(error: BaseException, sources: Sources | None, phase: Phase) -> bool:
    """Whether a failed batch can be searched for the sample that broke it (see the module
    docstring): ``phase`` is the worker's when it failed."""
    return (
        sources is not None
        and sources.sampled is not None
        and not sources.feeders
        and phase in (Phase.DALI, Phase.STEP, Phase.TRANSPORT)
        and context_of(error).phase is None
    )


class FailingSamples:
    """The search of one failed batch of ``sampled`` for the samples that fail alone."""

    def __init__(self, spec: WorkerSpec, ctx: Any, sampled: BatchedSamples, worker: int) -> None:
        """``ctx``: the worker's EvalContext; ``worker``: its number (for the log)."""
        self._spec = spec
        self._ctx = ctx
        self._sampled = sampled
        self._worker = worker
        #: what the failing samples printed when run alone (native log lines, each once)
        self.printed: list[str] = []

    def outcome(self, error: BaseException, epoch: int, done: int) -> wire.SamplesFailed:
        """After batch ``done`` of ``epoch`` failed with ``error``: with ``on_error="skip"``
        and samples found, the record that names them (the worker sends it and ends: a process
        whose captured pipeline failed must not trace again, DALI 2.4 then crashes with
        captured random operators). Otherwise, or when no sample fails alone, raise ``error``,
        its message naming them first."""
        sampled = self._sampled
        if _data_fault(error):  # (no sample loads: nothing for the step to be blamed for)
            raise error
        failing = self.find(epoch, done)
        if failing is None:
            attach(error, message=every_sample_fails(error))
            raise error
        printed = list(dict.fromkeys(line for lines in failing.values() for line in lines))
        self.printed = printed
        if self._spec.on_error != "skip" or not failing:
            if failing:
                names = [sampled.describe(index) for index in failing]
                attach(error, message=failure_message(error, names, printed))
            raise error
        return wire.SamplesFailed(
            epoch=epoch,
            step=done,
            ids=tuple(failing),
            names=tuple(sampled.name(index) for index in failing),
            reason=short_reason(error, printed),
            kind=wire.UNDECODABLE if failed_in_decoder(error) else wire.IN_STEP,
        )

    def find(self, epoch: int, step: int) -> dict[int, list[str]] | None:
        """The samples of the batch at ``step`` of ``epoch`` (or, when DALI's prefetch
        reported it early, of the next one) that fail on their own, each with the native log
        lines it printed then. None when every sample of a batch of several fails alone: then
        ``step`` or the pipeline is at fault, not the data."""
        sampled = self._sampled
        for candidate in (step, step + 1):
            found = sampled.batch_at(epoch, candidate)
            if found is None:
                continue
            batch, replaced = found
            ids = [index for index in dict.fromkeys(batch) if index not in replaced]
            failing: dict[int, list[str]] = {}
            for index in ids:
                with _stderr.repeats_captured() as printed:
                    fails = self._fails(index, epoch)
                if fails:
                    failing[index] = printed.native
                if printed.native:
                    logger.debug(
                        "worker %d: %s printed when run alone: %s",
                        self._worker,
                        sampled.describe(index),
                        "; ".join(printed.native),
                    )
            if failing:
                return failing if len(failing) < len(ids) or len(ids) == 1 else None
        return {}

    def _fails(self, index: int, epoch: int) -> bool:
        """Whether sample ``index`` fails when loaded and run through ``step`` alone."""
        import numpy as np
        import nvidia.dali.experimental.dynamic as ndd

        sampled = self._sampled
        try:
            sample = sampled.load_sample(index, epoch)
            if sampled.num_outputs == 1:
                inputs: Any = ndd.batch([np.asarray(sample)])
            else:
                inputs = tuple(ndd.batch([np.asarray(part)]) for part in sample)
            with self._ctx:
                named, _kind = normalize_outputs(self._spec.call_step(inputs, {}))
                for batch in named.values():
                    dali.storage_of(batch)  # evaluate: DALI's errors surface here
        except Exception:
            return True
        return False


def _data_fault(error: BaseException | None) -> bool:
    """Whether ``error`` (or what it wraps) is the data's alone: no sample of a batch loads."""
    seen = 0
    while error is not None and seen < 8:
        if getattr(error, "_loader_data_fault", False):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False
