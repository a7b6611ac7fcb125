"""Observation: what the loader tells about a run, from the engine's read-only snapshots.

Owns: the trace (:mod:`._trace`, Chrome trace-event JSON), the verdict (:mod:`._diagnose`,
``Loader.diagnose()``) and its advice (:mod:`._advice`). Reads; never starts, stops or changes
anything.

May import: ``loader._errors``, :mod:`loader.config`, :mod:`loader.engine` (its stats and
timeline), ``workers``, ``ipc``.
"""
