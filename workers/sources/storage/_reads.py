"""What this worker process's sources read for their samples: units (Parquet row groups), ranged
requests and their bytes, counted by the readers (:mod:`workers.sources.parquet._reader`) and
sent with every batch (``wire.BatchReady.reads``): what ``stats()`` and the doctor report. Counted
per process (a source built again, a resume's seek, keeps counting); reads of plans (footers,
listings, summaries) are not counted here.

A read is counted with the epoch it was made for. A worker runs ahead of the trainer into the
next epoch (its sources feed on across epochs, and a reader fetches the next epoch's first row
groups ahead), so a batch of epoch ``e`` reports the reads made for epochs up to ``e`` only: the
counts ``stats()`` shows after an epoch's last batch are that epoch's and the ones before, not
the next epoch's read-ahead besides.
"""

from __future__ import annotations

import threading

__all__ = ["count_read", "reads_so_far"]

_lock = threading.Lock()
_reported = [0, 0, 0]  # units, requests, bytes: of the epochs reported so far, and unplanned
_ahead: dict[int, list[int]] = {}  # epoch -> the same, of epochs not reported yet


def count_read(units: int, requests: int, nbytes: int, epoch: int | None = None) -> None:
    """Count ``requests`` ranged reads of ``nbytes`` bytes in all, that read ``units`` units,
    for ``epoch`` (None: outside any epoch's plan; counted at once)."""
    with _lock:
        counts = _reported if epoch is None else _ahead.setdefault(epoch, [0, 0, 0])
        counts[0] += units
        counts[1] += requests
        counts[2] += nbytes


def reads_so_far(through: int | None = None) -> tuple[int, int, int]:
    """(units, requests, bytes) read by this process's sources since it started, for epochs up
    to ``through`` (None: every epoch). Never fewer than a call before reported."""
    with _lock:
        for epoch in [e for e in _ahead if through is None or e <= through]:
            counts = _ahead.pop(epoch)
            for k in range(3):
                _reported[k] += counts[k]
        return (_reported[0], _reported[1], _reported[2])
