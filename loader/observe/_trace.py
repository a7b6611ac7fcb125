"""``loader.save_trace()``: the last seconds of the time line as Chrome trace-event JSON. Runs
in the trainer.

The file opens in Perfetto (ui.perfetto.dev, "Open trace file") and in ``chrome://tracing``. One
process (the trainer's pid) holds one track (thread) for the trainer and one per worker:

* a worker's track has, per batch, its ``load`` (waiting for the source's samples; only when
  there was any), ``dali``, ``blocked`` (waiting for a free slot; only when it did) and
  ``publish`` spans, back to back from the batch's start in that order, and an ``idle`` span
  before a batch that waited for a command;
* the trainer's track has a ``next`` span for each ``next(loader)`` (``waited_ms`` in its args:
  how much of it was spent waiting for the workers, the rest is handing the batch out) and a
  ``train`` span for the time between two of them;
* where the start went (category ``start``, from the loader's creation on): on a worker's track,
  ``worker start`` (from its fork, or a spawned worker's entry, to its sources; a spawned one also
  shows its ``import DALI`` and ``DALI's source analysis``) and ``sources`` (building them: for
  tar shards, the node's summary and the epoch's plan); on a ``worker server`` track after the
  workers', what the server still did after the loader was made: ``import DALI``, ``DALI's
  source analysis``, ``storage backends`` (:mod:`workers.startup._warm_storage`), ``main
  module``, ``the loader's modules``, ``the dataset's readers`` (what the definition opens:
  its store's backend, pyarrow for Parquet). A start right after ``import loader`` shows the
  server's import of DALI before every worker's fork; the first batch's trace (``dali`` of step 0)
  follows ``sources``.

One file per rank: under a launcher with more than one rank, each rank writes its own file
(:func:`rank_path`): ``{rank}`` in the file's name is replaced by the rank, else ``.rank<k>`` goes
before the extension (``trace.json`` -> ``trace.rank1.json``); a world of one writes the path as
given. (Gathering every rank's tracks into rank 0's file would need a collective at ``close()``,
which runs from finalizers and ``atexit`` too, where a collective can hang.)

Every span is a complete event (``"ph": "X"``, microseconds since the loader was made) whose
``args`` hold the batch's ``epoch`` and ``step`` (the epoch's step; ``-1`` for a ``next()``
that ended an epoch) and, for the trainer's, the ``worker`` that made the batch. The spans are
rebuilt from each batch's stage times (``ipc.wire.StageTimes``): their lengths are measured,
their order within a batch is the order of the stages.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..engine import StartSpan, Timeline, batch_end

_TRAINER_TID = 0
#: In a trace path, replaced by the rank.
RANK_PLACEHOLDER = "{rank}"


def rank_path(path: str | os.PathLike[str], rank: int, world_size: int) -> Path:
    """Where ``rank`` of ``world_size`` writes the trace asked for at ``path``: the file name's
    ``{rank}`` replaced by the rank; else, with more than one rank, ``.rank<k>`` before the
    extension (``loader-trace.json`` -> ``loader-trace.rank1.json``); else ``path``."""
    target = Path(path)
    name = target.name
    if RANK_PLACEHOLDER in name:
        return target.with_name(name.replace(RANK_PLACEHOLDER, str(rank)))
    if world_size <= 1:
        return target
    stem, dot, extension = name.rpartition(".")
    if not dot or not stem:  # no extension ("trace", ".trace")
        return target.with_name(f"{name}.rank{rank}")
    return target.with_name(f"{stem}.rank{rank}.{extension}")


def trace_events(
    timeline: Timeline,
    seconds: float,
    worker_names: Sequence[str],
    *,
    pid: int,
    name: str,
) -> dict[str, Any]:
    """The trace of the last ``seconds`` of ``timeline`` (up to its latest record)."""
    start = _latest(timeline) - int(seconds * 1e9)
    spans = _Spans(pid, timeline.origin_ns)
    spans.names(name, worker_names)
    previous_left: int | None = None
    for entered, left, waited, epoch, step, worker in timeline.next_records(start):
        if previous_left is not None:
            spans.span(
                _TRAINER_TID, "train", previous_left, entered - previous_left, {"epoch": epoch}
            )
        args = {"epoch": epoch, "step": step, "worker": worker, "waited_ms": waited / 1e6}
        spans.span(_TRAINER_TID, "next", entered, left - entered, args)
        previous_left = left
    for index in range(min(len(worker_names), len(timeline.workers))):
        for epoch, step, blocked, times in timeline.worker_records(index, start):
            spans.batch(index + 1, {"epoch": epoch, "step": step}, blocked, times)
    spans.starts(timeline, start, len(worker_names))
    return {
        "traceEvents": spans.events,
        "displayTimeUnit": "ms",
        "otherData": {"source": "dali-capture-loader", "seconds": seconds},
    }


class _Spans:
    """The trace's events as they are made: one process, the trainer's track and one per
    worker."""

    def __init__(self, pid: int, origin_ns: int) -> None:
        self.pid, self.origin_ns = pid, origin_ns
        self.events: list[dict[str, Any]] = []

    def names(self, name: str, worker_names: Sequence[str]) -> None:
        """The process's and every track's name, the trainer's first."""
        pid = self.pid
        self.events += [
            _meta("process_name", pid, _TRAINER_TID, name),
            _meta("thread_name", pid, _TRAINER_TID, "trainer"),
            _sort_index(pid, _TRAINER_TID),
        ]
        for index, worker_name in enumerate(worker_names):
            tid = index + 1
            self.events.append(_meta("thread_name", pid, tid, worker_name))
            self.events.append(_sort_index(pid, tid))

    def span(
        self,
        tid: int,
        label: str,
        begin_ns: int,
        length_ns: int,
        args: dict[str, Any],
        category: str | None = None,
    ) -> None:
        self.events.append(
            {
                "ph": "X",
                "name": label,
                "cat": category or ("trainer" if tid == _TRAINER_TID else "worker"),
                "pid": self.pid,
                "tid": tid,
                "ts": (begin_ns - self.origin_ns) / 1e3,
                "dur": length_ns / 1e3,
                "args": args,
            }
        )

    def starts(self, timeline: Timeline, start_ns: int, num_workers: int) -> None:
        """Each worker's latest start on its track, and what the worker server did for it on
        a track of its own (after the workers'), each span once."""
        server: dict[StartSpan, None] = {}
        for index, parts in sorted(timeline.starts.items()):
            if index >= num_workers:
                continue
            for name, begin, end in parts.own:
                if end >= start_ns:
                    self.span(index + 1, name, begin, end - begin, {}, "start")
            server.update(dict.fromkeys(s for s in parts.server if s[2] >= start_ns))
        if not server:
            return
        tid = num_workers + 1
        self.events.append(_meta("thread_name", self.pid, tid, "worker server"))
        self.events.append(_sort_index(self.pid, tid))
        for name, begin, end in sorted(server, key=lambda s: s[1]):
            self.span(tid, name, begin, end - begin, {}, "start")

    def batch(self, tid: int, args: dict[str, Any], blocked: int, times: Any) -> None:
        """One worker's batch: idle, load, DALI, blocked on a slot, publish, in turn."""
        at = times.started_ns
        if times.idle_ns:
            self.span(tid, "idle", at - times.idle_ns, times.idle_ns, args)
        if times.load_ns:
            load_args = {**args, "read_ms": times.read_ns / 1e6}
            load_args["read_cpu_ms"] = times.read_cpu_ns / 1e6
            self.span(tid, "load", at, times.load_ns, load_args)
        at += times.load_ns
        self.span(tid, "dali", at, times.dali_ns, {**args, "cpu_ms": times.cpu_ns / 1e6})
        at += times.dali_ns
        if blocked:
            self.span(tid, "blocked", at, blocked, args)
        at += blocked
        self.span(tid, "publish", at, times.publish_ns, args)


def write_trace(path: str | os.PathLike[str], trace: dict[str, Any]) -> Path:
    """Write ``trace`` to ``path`` (through a temporary file beside it, renamed into place)."""
    target = Path(path)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "w", encoding="utf-8") as file:
            json.dump(trace, file, separators=(",", ":"))
        os.replace(temporary, target)
    finally:
        if temporary.exists():
            temporary.unlink()
    return target


def _latest(timeline: Timeline) -> int:
    ends = [timeline.left_ns or timeline.origin_ns]
    for track in timeline.workers:
        if track.records:
            _epoch, _step, blocked, times = track.records[-1]
            ends.append(batch_end(times, blocked))
    return max(ends)


def _meta(kind: str, pid: int, tid: int, name: str) -> dict[str, Any]:
    return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": {"name": name}}


def _sort_index(pid: int, tid: int) -> dict[str, Any]:
    """Tracks in the order of their ids: the trainer's, the workers', the worker server's."""
    return {
        "ph": "M",
        "name": "thread_sort_index",
        "pid": pid,
        "tid": tid,
        "args": {"sort_index": tid},
    }
