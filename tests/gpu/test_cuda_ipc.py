"""CUDA IPC slot ring between two processes (skipped without a GPU and CuPy; no DALI needed)."""

from __future__ import annotations

import multiprocessing
import time

import pytest

cupy = pytest.importorskip("cupy")
try:
    HAVE_GPU = cupy.cuda.runtime.getDeviceCount() > 0
except Exception:
    HAVE_GPU = False
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAVE_GPU, reason="needs an NVIDIA GPU")]

from ipc import _wire as wire  # noqa: E402
from ipc._cuda import SLOT_ALIGN, CudaImporter  # noqa: E402
from tests.gpu._exporter import fill_slots  # noqa: E402


def run_ring(nbytes: int, batches: int, num_slots: int = 3, check: bool = True) -> float:
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=fill_slots, args=(child, nbytes, batches, num_slots))
    process.start()
    child.close()
    importer = None
    try:
        ready = parent.recv()
        assert isinstance(ready, wire.CudaRingReady)
        assert ready.slot_size % SLOT_ALIGN == 0
        importer = CudaImporter(
            ready.arena_id, 0, ready.slot_size, ready.memory_handles, ready.ready_handles
        )
        parent.send(wire.CudaFreeEvents(ready.arena_id, importer.free_handles))
        stream = cupy.cuda.get_current_stream()
        started = time.perf_counter()
        received = 0
        while True:
            message = parent.recv()
            if isinstance(message, wire.EpochEnd):
                break
            importer.wait_ready(message.slot, stream.ptr)
            view = importer.array(message.slot, 0, (nbytes,), "uint8", None)
            if check:
                assert int(view[0]) == message.step % 251
                assert int(view[-1]) == message.step % 251
            else:
                view.sum()  # touch it on the stream, as a consumer would
            importer.mark_free(message.slot, stream.ptr)
            parent.send(wire.Release(((message.slot, message.generation),)))
            received += 1
        stream.synchronize()
        elapsed = time.perf_counter() - started
        assert received == batches
        parent.send(wire.Shutdown())
        process.join(30)
        assert process.exitcode == 0
        return nbytes * batches / elapsed
    finally:
        if importer is not None:
            importer.close()
        if process.is_alive():
            process.kill()
            process.join()
        parent.close()


def test_fills_arrive_intact_and_slots_are_reused() -> None:
    run_ring(nbytes=3 * 2**20 + 7, batches=40, num_slots=3)


def test_large_batches_move_at_device_speed() -> None:
    rate = run_ring(nbytes=50 * 2**20, batches=30, num_slots=3, check=False)
    assert rate > 1e9  # a host round trip would be far below this
