"""Resume cost, side by side in one run: ``python -m bench.resume``.

The images workload over ``sharded_files`` (W=2): time from ``load_state_dict`` to the first batch
when resuming at 0%, 50% and 90% of an epoch, next to a fresh loader's first batch; and the
trainer-side bookkeeping that makes positions possible (one counter per delivered batch), against
the trainer's cost per tiny batch.
"""

from __future__ import annotations

import functools
import statistics
import time
import timeit

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
        started = time.perf_counter()
        if fraction is not None:
            done = int(steps * fraction)
            loader.load_state_dict(_state(total, [done, done]))
        batch = next(iter(loader))
        elapsed = time.perf_counter() - started
        del batch
    return elapsed


def bookkeeping_seconds() -> float:
    """One delivered-batch counter increment, as the coordinator does it per batch."""

    class Session:
        delivered = 0

    session = Session()
    count = 1_000_000
    return timeit.timeit("session.delivered += 1", globals={"session": session}, number=count) / (
        count
    )


def main() -> None:
    root = str(ensure_sample_dataset())
    total = len(list_images(root)[0])
    rows = []
    for label, fraction in (
        ("fresh loader", None),
        ("resume at 0%", 0.0),
        ("resume at 50%", 0.5),
        ("resume at 90%", 0.9),
    ):
        times = [time_to_first_batch(root, total, fraction) for _ in range(3)]
        rows.append((label, statistics.median(times)))
    print(f"{'images, sharded_files, W=2':<28} {'first batch s':>14} {'vs 0%':>7}")
    base = rows[1][1]
    for label, seconds in rows:
        print(f"{label:<28} {seconds:>14.3f} {seconds / base:>6.2f}x")
    per = bookkeeping_seconds()
    tiny_batch = 1 / 3000  # the tiny workload moves ~3,000 batches/s (python -m bench)
    print(
        f"\nposition bookkeeping per batch: {per * 1e9:.0f} ns = {100 * per / tiny_batch:.3f}% "
        "of a tiny batch at 3,000 batches/s (target <= 0.5%)"
    )


if __name__ == "__main__":
    main()
