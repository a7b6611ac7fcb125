"""A worker's start: where its time went, and what is kept on disk so that the next start is
shorter. Runs in worker servers and workers, never in the trainer.

Owns: the start's named spans (:mod:`._spans`: :func:`span`, :func:`record`, sent to the trainer
with the worker's ``Hello``), DALI's source analysis kept on disk (:mod:`._analysis_cache`:
:func:`load_analysis`, :func:`store_analysis`) and the storage backends a script's workers opened
and the format libraries its readers imported (:mod:`._warm_storage`: a source notes each with
:func:`opened` or :func:`used`; the script's next worker server imports them as it warms,
:func:`warm`).

May import: the standard library (fsspec and its backends only inside functions). Nothing else
of ``workers``: the sources and everything above them import it.
"""

from ._analysis_cache import load_analysis, store_analysis
from ._spans import process_started, record, span, spans, started_ns
from ._warm_storage import import_needs, opened, used, warm, with_session

__all__ = [
    "import_needs",
    "load_analysis",
    "opened",
    "process_started",
    "record",
    "span",
    "spans",
    "started_ns",
    "store_analysis",
    "used",
    "warm",
    "with_session",
]
