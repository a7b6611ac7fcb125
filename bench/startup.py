"""Startup and epoch boundaries, side by side in one run: ``python -m bench.startup``.

The tiny workload with W=2, three loaders in a row in one process (as a test suite builds
them): seconds from ``Loader(...)`` to the first batch, and milliseconds from the last batch of
epoch e to the first batch of epoch e+1, for ``start_method="spawn"`` (each worker imports DALI)
and ``"forkserver"`` (the server imports DALI once; workers are forked from it). Each start
method runs in its own interpreter, so the forkserver starts fresh.
"""

from __future__ import annotations

import functools
import json
import statistics
import subprocess
import sys
import time

from bench import _sources as S
from loader import Loader


def measure(start_method: str, loaders: int = 3) -> dict[str, list[float]]:
    source = functools.partial(S.tiny_source, batches=200)
    first: list[float] = []
    boundary: list[float] = []
    for _ in range(loaders):
        started = last = time.perf_counter()
        with Loader(
            source, S.tiny_step, batch_size=S.TINY_BATCH, num_workers=2, start_method=start_method
        ) as loader:
            for epoch in range(3):
                batches = iter(loader)
                batch = next(batches)
                now = time.perf_counter()
                if epoch == 0:
                    first.append(now - started)
                else:
                    boundary.append(1000 * (now - last))
                del batch
                for batch in batches:
                    del batch
                last = time.perf_counter()
    return {"first": first, "boundary": boundary}


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        print(json.dumps(measure(sys.argv[2])))
        return
    print(
        f"{'start method':<13} {'1st loader s':>12} {'later loaders s':>16} "
        + f"{'epoch boundary ms':>18}"
    )
    for method in ("spawn", "forkserver"):
        out = subprocess.run(
            [sys.executable, "-m", "bench.startup", "--one", method],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        result = json.loads(out.strip().splitlines()[-1])
        later = statistics.median(result["first"][1:])
        print(
            f"{method:<13} {result['first'][0]:>12.2f} {later:>16.2f} "
            f"{statistics.median(result['boundary']):>18.1f}"
        )
    print("target: time to the first batch <= 1.0 s (tiny, W=2)")


if __name__ == "__main__":
    main()
