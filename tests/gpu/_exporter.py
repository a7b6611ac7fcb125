"""A worker stand-in for the GPU tests: fills CUDA slots with cupy, no DALI (spawned process)."""

from __future__ import annotations

from multiprocessing.connection import Connection

from ipc import SlotRing
from ipc import _wire as wire
from ipc._cuda import CudaExporter


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
    stream = cupy.cuda.ExternalStream(exporter.stream.ptr)
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
