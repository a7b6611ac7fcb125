"""A worker stand-in for the GPU tests and bench: fills CUDA slots with cupy, no DALI.

``fill_slots`` runs in a spawned process; ``run_ring`` is the trainer's side of it.
"""

from __future__ import annotations

import multiprocessing
import time
from multiprocessing.connection import Connection

from ipc import SlotRing, wire
from ipc._cuda import SLOT_ALIGN, CudaExporter, CudaImporter


def fill_slots(conn: Connection, nbytes: int, batches: int, num_slots: int) -> None:
    """Publish ``batches`` fills of ``nbytes``; fill k holds the byte value ``k % 251``."""
    import cupy

    cupy.cuda.Device(0).use()
    exporter = CudaExporter(1, 0, nbytes, num_slots)
    ring = SlotRing(num_slots)
    conn.send(
        wire.CudaRingReady(
            1, 0, exporter.slot_size, exporter.memory_handles, exporter.ready_handles
        )
    )
    source = cupy.empty(nbytes, dtype=cupy.uint8)
    stream = cupy.cuda.ExternalStream(exporter.stream)
    for k in range(batches):
        slot = ring.acquire()
        while slot is None:
            message = conn.recv()
            if isinstance(message, wire.CudaFreeEvents):
                exporter.set_free_events(message.handles)
            elif isinstance(message, wire.Release):
                for fill in message.fills:
                    ring.release(*fill)
            slot = ring.acquire()
        base = exporter.begin_write(slot)
        with stream:
            source.fill(k % 251)
        exporter.copy_in(slot, 0, source.data.ptr, nbytes)
        exporter.finish_write(slot)
        generation = ring.publish(slot)
        placement = wire.OutputPlacement("x", "|u1", 0, nbytes, ((nbytes,),), True, "")
        conn.send(wire.BatchReady(0, k, 1, slot, generation, (placement,), nbytes, 0, 0, 0))
        del base
    conn.send(wire.EpochEnd(0, batches, 0, 0))
    while True:  # wait for the trainer to finish with every slot before freeing memory
        message = conn.recv()
        if isinstance(message, wire.Shutdown):
            break
    exporter.close()
    conn.close()


def run_ring(nbytes: int, batches: int, num_slots: int = 3, check: bool = True) -> float:
    """Trainer side: import the ring ``fill_slots`` exports, consume ``batches`` fills on the
    current stream (checking their bytes with ``check``); returns bytes per second."""
    import cupy

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
