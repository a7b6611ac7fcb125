"""Resume cost, side by side in one run: ``python -m bench.resume``.

The images workload over ``sharded_files`` (W=2): time from ``load_state_dict`` to the first batch
when resuming at 0%, 50% and 90% of an epoch, next to a fresh loader's first batch; and the
trainer-side bookkeeping that makes positions possible (one counter per delivered batch), against
the trainer's cost per tiny batch.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import timeit

from bench import _harness as H
from bench import _sources as S
from loader import Loader, ensure_sample_dataset, list_images
from loader.sample import image_step

BATCH = 64


def _state(total: int, received: list[int]) -> dict[str, object]:
    return {
        "format": 3,
        "seed": 0,
        "epoch": 0,
        "batch_size": BATCH,
        "sampling": {"total": total, "shuffle": True, "drop_last": False},
        "layout": {"world_size": 1, "num_workers": len(received)},
        "received": received,
        "history": [],
    }


def time_to_first_batch(root: str, total: int, fraction: float | None) -> float:
    source = functools.partial(S.files_source, root=root, batch_size=BATCH)
    with Loader(source, image_step, batch_size=BATCH, num_workers=2) as loader:
        steps = len(loader) // 2
        with H.Clock() as clock:
            if fraction is not None:
                done = int(steps * fraction)
                loader.load_state_dict(_state(total, [done, done]))
            batch = next(iter(loader))
        del batch
    return clock.wall


def bookkeeping_seconds() -> float:
    """One delivered-batch counter increment, as the coordinator does it per batch."""

    class Session:
        delivered = 0

    session = Session()
    count = 1_000_000
    return timeit.timeit("session.delivered += 1", globals={"session": session}, number=count) / (
        count
    )


def parser() -> argparse.ArgumentParser:
    return H.parser("resume", __doc__)


def main(argv: list[str] | None = None) -> None:
    parser().parse_args(argv)
    root = str(ensure_sample_dataset())
    total = len(list_images(root)[0])
    fractions = {
        "fresh loader": None,
        "resume at 0%": 0.0,
        "resume at 50%": 0.5,
        "resume at 90%": 0.9,
    }
    found = H.paired(
        {
            label: functools.partial(time_to_first_batch, root, total, fraction)
            for label, fraction in fractions.items()
        },
        rounds=3,
        order="fixed",
    )
    medians = {label: statistics.median(t.value for t in runs) for label, runs in found.items()}
    base = medians["resume at 0%"]
    H.print_table(
        [
            H.Col("images, sharded_files, W=2", left=True),
            H.Col("first batch s", ".3f"),
            H.Col("vs 0%"),
        ],
        [(label, seconds, H.ratio(seconds, base)) for label, seconds in medians.items()],
    )
    per = bookkeeping_seconds()
    tiny_batch = 1 / 3000  # the tiny workload moves ~3,000 batches/s (python -m bench)
    print(
        f"\nposition bookkeeping per batch: {per * 1e9:.0f} ns = {100 * per / tiny_batch:.3f}% "
        "of a tiny batch at 3,000 batches/s (target <= 0.5%)"
    )


if __name__ == "__main__":
    main()
