"""What a worker tells the trainer besides its control replies: each batch copied into a slot and
described (:mod:`._publish`), an epoch's signature (:mod:`._signature`), each batch's stage times
(:mod:`._timing`), and a failure's record: DALI's long error text condensed, the failing samples
named first (:mod:`._error_text`), with what the worker knows of the error beyond the error
itself (:mod:`workers.spec._error_context`, re-exported here). Runs in the worker, on its main
thread.

Publishing and the signature import DALI (:mod:`workers.dali`): :class:`Publisher`,
:class:`Signature` and :func:`normalize_outputs` are imported on first use, so that importing
``workers`` (the trainer does) imports no DALI.

May import: ``ipc``, :mod:`workers.dali`, :mod:`workers.spec`. Nothing else of ``workers``: the
sources and the capture loops import it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..spec import attach, context_of
from ._error_text import (
    FAILING_SAMPLES,
    every_sample_fails,
    failed_in_decoder,
    failure,
    message,
    short_reason,
)
from ._timing import BatchClock

if TYPE_CHECKING:
    from ._publish import Publisher, normalize_outputs
    from ._signature import Signature


def __getattr__(name: str) -> Any:
    """Publishing's names, imported on first use (their modules import DALI)."""
    if name in ("Publisher", "normalize_outputs"):
        from . import _publish

        return getattr(_publish, name)
    if name == "Signature":
        from . import _signature

        return _signature.Signature
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FAILING_SAMPLES",
    "BatchClock",
    "Publisher",
    "Signature",
    "attach",
    "context_of",
    "every_sample_fails",
    "failed_in_decoder",
    "failure",
    "message",
    "normalize_outputs",
    "short_reason",
]
