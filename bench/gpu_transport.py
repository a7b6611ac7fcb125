"""GPU worker -> trainer transport through the CUDA IPC slot ring (python -m bench.gpu_transport).

Side by side in one run: (a) a same-process device-to-device copy of 50 MB (cupy), (b) the ring:
a spawned process fills 50 MB slots on its stream and the trainer consumes them on its stream
(waits on the "ready" event, records "free"), no DALI involved. Prints GB/s and the ratio.
"""

from __future__ import annotations

import statistics
import time


def device_copy(nbytes: int, repeats: int) -> float:
    import cupy

    source = cupy.ones(nbytes, dtype=cupy.uint8)
    target = cupy.empty_like(source)
    target[...] = source
    cupy.cuda.get_current_stream().synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        target[...] = source
    cupy.cuda.get_current_stream().synchronize()
    return nbytes * repeats / (time.perf_counter() - started)


def main() -> None:
    from tests.gpu._exporter import run_ring

    nbytes = 50 * 10**6
    copies = [device_copy(nbytes, 50) for _ in range(3)]
    rings = [run_ring(nbytes, 60, num_slots=3, check=False) for _ in range(3)]
    copy, ring = statistics.median(copies), statistics.median(rings)
    print(f"{'path':<34} {'GB/s':>8}")
    print(f"{'same-process D2D copy (50 MB)':<34} {copy / 1e9:>8.1f}")
    print(f"{'CUDA IPC slot ring (50 MB)':<34} {ring / 1e9:>8.1f}")
    print(f"ratio ring / copy: {ring / copy:.2f} (target >= 0.8)")


if __name__ == "__main__":
    main()
