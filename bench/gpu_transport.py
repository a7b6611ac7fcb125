"""GPU worker -> trainer transport through the CUDA IPC slot ring (python -m bench.gpu_transport).

Side by side in one run: (a) a same-process device-to-device copy of 50 MB (cupy), (b) the ring:
a spawned process fills 50 MB slots on its stream and the trainer consumes them on its stream
(waits on the "ready" event, records "free"), no DALI involved. Prints GB/s and the ratio.
"""

from __future__ import annotations

import argparse
import functools
import statistics

from bench import _harness as H


def device_copy(nbytes: int, repeats: int) -> float:
    import cupy

    source = cupy.ones(nbytes, dtype=cupy.uint8)
    target = cupy.empty_like(source)
    target[...] = source
    cupy.cuda.get_current_stream().synchronize()
    with H.Clock() as clock:
        for _ in range(repeats):
            target[...] = source
        cupy.cuda.get_current_stream().synchronize()
    return nbytes * repeats / clock.wall


def parser() -> argparse.ArgumentParser:
    return H.parser("gpu_transport", __doc__)


def main(argv: list[str] | None = None) -> None:
    parser().parse_args(argv)
    from tests.gpu._exporter import run_ring

    nbytes = 50 * 10**6
    found = H.paired(
        {
            "same-process D2D copy (50 MB)": functools.partial(device_copy, nbytes, 50),
            "CUDA IPC slot ring (50 MB)": functools.partial(
                run_ring, nbytes, 60, num_slots=3, check=False
            ),
        },
        rounds=3,
    )
    copy, ring = (statistics.median(t.value for t in runs) for runs in found.values())
    H.print_table(
        [H.Col("path", left=True), H.Col("GB/s", ".1f")],
        [(name, statistics.median(t.value for t in runs) / 1e9) for name, runs in found.items()],
    )
    print(f"ratio ring / copy: {ring / copy:.2f} (target >= 0.8)")


if __name__ == "__main__":
    main()
