"""One start of this loader over a bucket of :mod:`bench.index_scale` (a process of its own):
``python -m bench._index_start URL OPTIONS_JSON`` builds a ``Loader`` over ``ParquetDataset(URL,
columns=("label", "id"))`` (2 workers, batches of 32, an empty node cache), takes its first
batch, and says ``{"first": seconds, "rss_mb": the trainer's, "workers_rss_mb": [...]}`` on
stdout; then it waits for a line on stdin (the parent counts the requests served so far) and
closes the loader."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from loader import Loader, ParquetDataset, ndd


def step(label: Any, ids: Any) -> dict[str, Any]:
    return {"label": ndd.cast(label, dtype=ndd.int64), "id": ndd.cast(ids, dtype=ndd.int64)}


def resident_mb(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as file:
        return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def main(url: str, options: str) -> None:
    started = time.monotonic()
    dataset = ParquetDataset(url, columns=("label", "id"), storage_options=json.loads(options))
    with Loader(dataset, step, batch_size=32, num_workers=2) as loader:
        next(iter(loader))
        seconds = time.monotonic() - started
        pids = [w.pid for w in loader.stats().workers if w.pid is not None]
        said = {
            "first": seconds,
            "rss_mb": resident_mb(os.getpid()),
            "workers_rss_mb": [round(resident_mb(pid)) for pid in pids],
        }
        sys.stdout.write(json.dumps(said) + "\n")
        sys.stdout.flush()
        sys.stdin.readline()


if __name__ == "__main__":
    main(*sys.argv[1:])
