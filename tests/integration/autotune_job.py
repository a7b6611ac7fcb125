"""A job for torchrun (gloo, CPU): num_workers="auto" on every rank; writes what each rank saw
to OUT/rank<N>.json. Run by tests/integration/test_autotune.py."""

from __future__ import annotations

import functools
import json
import logging
import sys
from pathlib import Path

import torch.distributed as dist

from loader import Loader
from tests import timing_pipelines as T

BATCH = 8
TOTAL = BATCH * 2 * 60 + 4  # padded: the epoch length depends on the layout


def main(out: Path) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    source = functools.partial(T.sleeping_source, total=TOTAL, batch_size=BATCH, seconds=0.002)
    epochs = []
    loader = Loader(
        source, T.id_step, batch_size=BATCH, num_workers="auto", start_method="forkserver"
    )
    with loader:
        for _ in range(3):
            length = len(loader)  # (the layout of this epoch starts here)
            workers = loader.num_workers
            ids, steps = [], 0
            for batch in loader:
                real = BATCH - batch.info.padded
                ids.extend(int(i) for i in batch["id"][:real].ravel())
                steps += 1
                del batch
            epochs.append({"workers": workers, "ids": ids, "steps": steps, "len": length})
        report = loader.stats().autotune
        assert report is not None
        summary = {
            "layout": [report.layout.workers, report.layout.threads],
            "settled": report.settled,
            "trials": [[t.layout.workers, t.layout.threads] for t in report.trials],
        }
    (out / f"rank{rank}.json").write_text(
        json.dumps({"epochs": epochs, "total": TOTAL, "report": summary})
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
