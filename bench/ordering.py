"""In-order against out-of-order delivery, side by side in one run: ``python -m bench.ordering``.

Two workloads, W=2 workers, the trainer spending 1 ms per batch (a model's step):

* heavy-tail: ``sharded_source`` whose per-sample load takes 0.2 ms, or 100 ms for 1% of
  samples (batches of 8); with ``in_order=True`` a slow batch on one worker stalls the trainer
  although the other worker has batches ready; ``in_order=False`` takes whichever is ready;
* tiny: the uniform tiny workload of ``python -m bench``: out-of-order must cost nothing there.

Reports batches/s (median of 3 epochs after a warm-up epoch) and the ratio.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

from bench import _harness as H
from bench import _sources as S
from loader import Loader

TRAINER_SECONDS = 1e-3


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def rate(source: object, step: object, batch_size: int, in_order: bool) -> float:
    with Loader(
        source,  # type: ignore[arg-type]
        step,  # type: ignore[arg-type]
        batch_size=batch_size,
        num_workers=2,
        num_threads=1,
        in_order=in_order,
    ) as loader:
        for batch in loader:  # warm-up: spawn, trace
            del batch
        rates = []
        for _ in range(3):
            count = 0
            with H.Clock() as clock:
                for batch in loader:
                    _spin(TRAINER_SECONDS)
                    count += 1
                    del batch
            rates.append(count / clock.wall)
    return statistics.median(rates)


def parser() -> argparse.ArgumentParser:
    return H.parser("ordering", __doc__)


def main(argv: list[str] | None = None) -> None:
    parser().parse_args(argv)
    workloads = {
        "heavy-tail": (
            functools.partial(S.heavy_tail_source, total=8 * 240, batch_size=8),
            S.soak_step,
            8,
        ),
        "tiny": (functools.partial(S.tiny_source, batches=600), S.tiny_step, S.TINY_BATCH),
    }
    rows = []
    for name, (source, step, batch_size) in workloads.items():
        found = H.paired(
            {
                "in_order=True": lambda: rate(source, step, batch_size, True),  # noqa: B023
                "in_order=False": lambda: rate(source, step, batch_size, False),  # noqa: B023
            },
            rounds=1,
            order="fixed",
        )
        ordered, unordered = (found[key][0].value for key in found)
        rows.append((name, ordered, unordered, unordered / ordered))
    H.print_table(
        [
            H.Col("workload", left=True),
            H.Col("in_order=True", ".1f", " b/s"),
            H.Col("in_order=False", ".1f", " b/s"),
            H.Col("ratio", ".2f", "x"),
        ],
        rows,
    )
    print("targets: heavy-tail ratio >= 1.2; tiny ratio ~1.0 (within noise)")


if __name__ == "__main__":
    main()
