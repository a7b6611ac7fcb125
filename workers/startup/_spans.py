"""Where a worker's start went: named spans (``time.perf_counter_ns``, ``CLOCK_MONOTONIC``, the
trainer's clock too), recorded by the worker server as it warms and prepares (every worker it
forks inherits them in its memory) and by the worker as it starts; sent to the trainer with the
worker's ``Hello`` (:class:`ipc.wire.Hello`) and drawn in the loader's trace
(:mod:`loader.observe._trace`).

A span is ``(name, begin_ns, end_ns, pid)``: the pid tells the worker's own spans from those of
the server it was forked from. Runs in worker servers and workers, never in the trainer.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

#: The most spans kept (a server that prepared many loaders keeps its latest).
KEPT = 32

_spans: list[tuple[str, int, int, int]] = []
_process_started: int | None = None


@contextlib.contextmanager
def span(name: str) -> Iterator[None]:
    """Record the block as ``name`` (also when it raises)."""
    begin = time.perf_counter_ns()
    try:
        yield
    finally:
        record(name, begin, time.perf_counter_ns())


def record(name: str, begin_ns: int, end_ns: int) -> None:
    """Record a span of this process."""
    _spans.append((name, begin_ns, end_ns, os.getpid()))
    del _spans[:-KEPT]


def process_started() -> None:
    """This process (a worker) starts now: a forked child right after the fork, a spawned one at
    its entry point."""
    global _process_started
    _process_started = time.perf_counter_ns()


def started_ns() -> int | None:
    """When :func:`process_started` was called in this process (None: never)."""
    return _process_started


def spans() -> tuple[tuple[str, int, int, int], ...]:
    """Every span recorded in this process and inherited from the server it was forked from."""
    return tuple(_spans)
