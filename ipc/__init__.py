"""Transport between trainer and workers: shared-memory arenas, slot bookkeeping, the wire format.

This package imports nothing else of the project; both ``workers`` and ``loader`` build on it.
"""

from ._arena import OUTPUT_ALIGN, PAGE, Arena, SharedMemoryError, SlotView, round_up
from ._channel import ChannelClosed, ControlChannel
from ._layout import check_fits, nbytes_of, place_outputs
from ._ring import SlotLedger, SlotRing, SlotState, StaleReleaseError

__all__ = [
    "OUTPUT_ALIGN",
    "PAGE",
    "Arena",
    "ChannelClosed",
    "ControlChannel",
    "SharedMemoryError",
    "SlotLedger",
    "SlotRing",
    "SlotState",
    "SlotView",
    "StaleReleaseError",
    "check_fits",
    "nbytes_of",
    "place_outputs",
    "round_up",
]
