"""A job for torchrun (gloo, CPU): every rank iterates a load that waits (sleeps) with
``trace=OUT/loader-trace.json``, calls ``diagnose()`` and writes what it said to
OUT/diagnosis<rank>.json. Run by tests/integration/test_torchrun.py."""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from loader import Loader
from tests import timing_pipelines as T

BATCH = 8


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # rank 1's load waits twice as long: the ranks' own figures differ
    seconds = 0.002 * (1 + rank)
    source = functools.partial(
        T.sleeping_source, total=BATCH * 2 * 2 * 20, batch_size=BATCH, seconds=seconds
    )
    with Loader(
        source, T.id_step, batch_size=BATCH, num_workers=2, trace=out / "loader-trace.json"
    ) as loader:
        pids = loader.worker_pids()
        for _ in range(2):
            for batch in loader:
                del batch
        report = loader.diagnose(window=60)
    (out / f"diagnosis{rank}.json").write_text(
        json.dumps(
            {
                "rank": report.rank,
                "world_size": report.world_size,
                "verdict": report.verdict,
                "input_bound": report.input_bound,
                "suggestion": report.suggestion,
                "job": report.job.settings,
                "budget": report.job.budget,
                "reason": report.job.reason,
                "ranks": list(report.job.ranks),
                "cpus": report.cpus,
                "node_cpus": report.node_cpus,
                "local_ranks": report.local_ranks,
                "usable_cpus": len(os.sched_getaffinity(0)),
                "text": str(report),
                "pid": os.getpid(),
                "worker_pids": pids,
            }
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
