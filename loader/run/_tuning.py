"""What ``num_workers="auto"`` measures, and the collective that makes every rank decide
alike. Runs in the trainer.

:func:`measure` reads an epoch off the timeline (:mod:`loader.engine._stats`) and the workers'
memory
off psutil; :func:`after_epoch` and :func:`at_start` gather every rank's figures (one
``all_gather_object`` with a process group up) and hand the combined figures to the policy,
:class:`loader.config._autotune.Autotuner`, which returns the decision. The same gather carries each
rank's host (:func:`loader.config.host_facts`), so the CPU budget is each host's CPUs split
among
its local ranks (``LOCAL_WORLD_SIZE``, else the ranks on the same host), the budget
``loader.diagnose()`` advises within.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..config import (
    Autotuner,
    Decision,
    Layout,
    Measurement,
    combine,
    distributed,
    host_facts,
    node_shares,
)
from ..engine import batch_end

if TYPE_CHECKING:
    from ..config import LoaderConfig
    from ..engine import Timeline, WorkerFacts


def measure(
    timeline: Timeline,
    facts: Sequence[WorkerFacts],
    epoch: int,
    *,
    layout: Layout,
    prefetch: int,
    num_slots: int,
    cpus: int,
    memory_limit: int,
) -> Measurement | None:
    """``epoch`` as the trainer received it (None when it had too few batches to tell): its
    rate and waits past the pool's first batches (the traced ones, and those prefetched before
    the trainer asked), the workers' CPU time then, and their memory now."""
    calls = []
    for call in reversed(timeline.calls):  # (the latest epoch's are last: stop before them)
        if call[3] < epoch:
            break
        if call[3] == epoch and call[4] >= 0:
            calls.append(call)
    calls.reverse()
    warm = layout.workers * (prefetch + 1)
    skip = warm if len(calls) >= 3 * warm else min(layout.workers, len(calls) // 2)
    if len(calls) - skip < 2:
        return None
    skip = max(1, skip)
    start, end = calls[skip - 1][1], calls[-1][1]
    seconds = (end - start) / 1e9
    waited = sum(c[2] for c in calls[skip:]) / 1e9
    busy = 0  # the workers' CPU time (every thread) in the batches made in the span
    for track in timeline.workers[: layout.workers]:
        for record in reversed(track.records):
            if record[0] < epoch:
                break
            if record[0] == epoch and batch_end(record[3], record[2]) >= start:
                busy += record[3].cpu_ns
    memory, largest = worker_memory(facts, num_slots)
    return Measurement(
        layout=layout,
        batches=len(calls) - skip,
        seconds=seconds,
        waiting=waited / seconds if seconds > 0 else 0.0,
        worker_cpus=busy / 1e9 / seconds if seconds > 0 else 0.0,
        memory=memory,
        worker_memory=largest,
        cpus=cpus,
        memory_limit=memory_limit,
    )


def worker_memory(facts: Sequence[WorkerFacts], num_slots: int) -> tuple[int, int]:
    """Bytes the workers hold, and the largest one's: each process's USS (its own pages, as
    psutil measures them) plus its shared-memory slots (``num_slots`` of its batch size)."""
    import psutil

    total = largest = 0
    for worker in facts:
        uss = 0
        if worker.pid is not None:
            try:
                uss = int(psutil.Process(worker.pid).memory_full_info().uss)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                uss = 0
        slots = num_slots * (worker.bytes // worker.steps) if worker.steps else 0
        total += uss + slots
        largest = max(largest, uss + slots)
    return total, largest


def after_epoch(
    tuner: Autotuner,
    timeline: Timeline,
    facts: Sequence[WorkerFacts],
    config: LoaderConfig,
    epoch: int,
) -> Decision | None:
    """The tuner's decision on ``epoch``, just delivered by ``facts`` on ``config``'s layout,
    measured on every rank and combined (a collective with a process group up); None when the
    epoch was too short to measure on some rank."""
    measured = measure(
        timeline,
        facts,
        epoch,
        layout=config.layout,
        prefetch=config.prefetch,
        num_slots=config.num_slots,
        cpus=config.cpus,
        memory_limit=config.memory_limit or tuner.memory_limit,
    )
    gathered = distributed.gather(
        {"measured": None if measured is None else measured.payload(), **host_facts()}
    )
    if gathered is not None:
        payloads = [g["measured"] for g in gathered]
        measured = None if None in payloads else combine(payloads)
        if measured is not None:
            measured = dataclasses.replace(measured, cpus=min(node_shares(gathered)))
    return None if measured is None else tuner.observe(epoch, measured)


def at_start(tuner: Autotuner, facts: Sequence[WorkerFacts], config: LoaderConfig) -> Decision:
    """Before the first epoch: the workers as started, measured on every rank (a collective
    with a process group up), must fit the memory budget; with every rank's host known, the
    CPU budget is the smallest share of any host's CPUs (a first guess made for more CPUs is
    replaced)."""
    memory, largest = worker_memory(facts, config.num_slots)
    gathered = distributed.gather({"memory": memory, "worker_memory": largest, **host_facts()})
    moved = False
    if gathered is not None:
        memory = max(int(g["memory"]) for g in gathered)
        largest = max(int(g["worker_memory"]) for g in gathered)
        moved = tuner.rebudget(min(node_shares(gathered)))
    decision = tuner.fit(memory, largest)
    return dataclasses.replace(decision, changed=True) if moved else decision
