"""What this worker process's sources read for their samples: units (Parquet row groups), ranged
requests and their bytes, counted by the readers (:mod:`workers.sources.parquet._reader`) and
sent with every batch (``wire.BatchReady.reads``): what ``stats()`` and the doctor report. Counted
per process (a source built again, a resume's seek, keeps counting); reads of plans (footers,
listings, summaries) are not counted here.
"""

from __future__ import annotations

import threading

__all__ = ["count_read", "reads_so_far"]

_lock = threading.Lock()
_counts = [0, 0, 0]  # units, requests, bytes


def count_read(units: int, requests: int, nbytes: int) -> None:
    """Count ``requests`` ranged reads of ``nbytes`` bytes in all, that read ``units`` units."""
    with _lock:
        _counts[0] += units
        _counts[1] += requests
        _counts[2] += nbytes


def reads_so_far() -> tuple[int, int, int]:
    """(units, requests, bytes) read by this process's sources since it started."""
    with _lock:
        return (_counts[0], _counts[1], _counts[2])
