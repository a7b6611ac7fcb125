"""An epoch's signature: what the trainer learns of the pipeline from its first steps. Runs in the
worker, on its main thread.

A signature (:class:`ipc.wire.Signature`) is due for an epoch that traces its capture loop, and
for the first epoch after the sources were built (see ``Activity.signature_due``). Its content is
gathered at the epoch's first step (the outputs' schema and the batch size) and it is sent after
the traced step, once DALI has ended the trace: over a sampled source (a dataset definition, a
``sharded_*`` function) when DALI first asks it for a batch after the traced one, before that
batch is loaded and run (``FeedState.at_next_pull``), which step 1's ``next(iterator)`` would
wait for (a first batch 20-40 ms sooner, as the trainer hands out no batch before every
worker's signature); otherwise when the loop's next call returns (step 1); at the epoch's end
when the epoch had a single step. :class:`Signature` holds one epoch's.
"""

from __future__ import annotations

import time
from typing import Any

from ipc import wire

from .. import dali
from ..spec import WorkerSpec
from ._publish import describe_outputs


class Signature:
    """One epoch's signature, gathered from its first step and taken once when due."""

    def __init__(self, due: bool, spec: WorkerSpec, source: Any) -> None:
        """``due``: whether this epoch sends one; ``source``: the driving source (whose
        capture state the signature reports)."""
        self._due = due
        self._spec = spec
        self._source = source
        self._started = time.perf_counter()
        self._schema: tuple[tuple[wire.OutputSchema, ...], str] | None = None
        self._batch_size = 0

    @property
    def batch_size(self) -> int:
        """The batch size of the epoch's first batch; 0 before it."""
        return self._batch_size

    def outputs(self, named: dict[str, Any], kind: str) -> None:
        """A step's normalised outputs: the first step's give the schema and the batch size."""
        if self._schema is None:
            self._schema = (describe_outputs(named), kind)
            self._batch_size = next(iter(named.values())).batch_size

    def take(self) -> wire.Signature | None:
        """The signature to send now, when it is due and its first step ran; once."""
        if not self._due or self._schema is None:
            return None
        self._due = False
        spec = self._spec
        outputs, kind = self._schema
        return wire.Signature(
            batch_size=self._batch_size,
            device=spec.device,
            device_id=spec.device_id,
            num_threads=spec.num_threads,
            outputs=outputs,
            output_kind=kind,
            captured=dali.capture_state(self._source, spec.capture) == "captured",
            capture_requested=spec.capture,
            dali_version=dali.DALI_VERSION,
            trace_seconds=time.perf_counter() - self._started,
        )
