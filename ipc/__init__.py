"""Transport between trainer and workers: slot memory, slot bookkeeping, the wire contract.

This package imports nothing else of the project; both ``workers`` and ``loader`` build on it.
Its public surface is this module, :mod:`ipc.wire` (the records both sides send) and
:mod:`ipc.limits` (what a container lets a process use: the CPUs, the memory, OOM kills).
"""

from ._arena import OUTPUT_ALIGN, PAGE, Arena, SharedMemoryError, SlotView, memfd_regions, round_up
from ._channel import ChannelClosed, ControlChannel
from ._layout import check_fits, nbytes_of, place_outputs, sample_offsets
from ._ring import SlotLedger, SlotRing, SlotState, StaleReleaseError
from ._transport import (
    ReaderRegion,
    RegionFactory,
    SlotReader,
    SlotWriter,
    WriterRegion,
    open_region,
)
from .wire import ProtocolError

__all__ = [
    "OUTPUT_ALIGN",
    "PAGE",
    "Arena",
    "ChannelClosed",
    "ControlChannel",
    "ProtocolError",
    "ReaderRegion",
    "RegionFactory",
    "SharedMemoryError",
    "SlotLedger",
    "SlotReader",
    "SlotRing",
    "SlotState",
    "SlotView",
    "SlotWriter",
    "StaleReleaseError",
    "WriterRegion",
    "check_fits",
    "cuda_regions",
    "memfd_regions",
    "nbytes_of",
    "open_region",
    "place_outputs",
    "round_up",
    "sample_offsets",
]


def cuda_regions(device_id: int, num_slots: int, stream: int) -> RegionFactory:
    """A region factory for :class:`SlotWriter`: CUDA IPC rings on ``device_id`` whose copies
    run on ``stream``. Imports CuPy when the first ring is made, not before."""

    def create(arena_id: int, slot_size: int, needed: int) -> WriterRegion:
        from ._cuda import CudaExporter

        return CudaExporter(arena_id, device_id, slot_size, num_slots, stream)

    return create
