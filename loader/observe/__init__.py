"""Observation: what the loader tells about a run, from the engine's read-only snapshots.

Owns: the trace (:mod:`._trace`, Chrome trace-event JSON), the verdict (:mod:`._diagnose`,
``Loader.diagnose()``) and its advice (:mod:`._advice`). Reads; never starts, stops or changes
anything.

May import: ``loader.errors``, :mod:`loader.config`, :mod:`loader.engine` (its stats and
timeline), ``workers``, ``ipc``.
"""

from ._diagnose import Diagnosis, diagnose, measure_headspace
from ._trace import rank_path, trace_events, write_trace

__all__ = [
    "Diagnosis",
    "diagnose",
    "measure_headspace",
    "rank_path",
    "trace_events",
    "write_trace",
]
