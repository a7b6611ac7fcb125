"""Packing a batch's outputs into one slot: where each output starts and how big it is.

Runs in the worker (to place outputs) and the trainer (to check a descriptor fits its slot, and
to cut a slot's bytes back into per-output arrays).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np

from ._arena import OUTPUT_ALIGN, round_up
from .wire import OutputPlacement, ProtocolError, Shape


def nbytes_of(shapes: Sequence[Shape], itemsize: int) -> int:
    """Bytes of samples of ``shapes`` with ``itemsize``-byte elements, back to back."""
    return sum(math.prod(shape) for shape in shapes) * itemsize


def place_outputs(
    outputs: Sequence[tuple[str, str, int, Sequence[Shape], str]],
) -> tuple[tuple[OutputPlacement, ...], int]:
    """Lay outputs ``(name, dtype, itemsize, shapes, layout)`` back to back, each aligned.

    Returns the placements and the total number of bytes the slot must hold.
    """
    placements = []
    offset = 0
    for name, dtype, itemsize, shapes, layout in outputs:
        shapes = tuple(tuple(int(d) for d in shape) for shape in shapes)
        nbytes = nbytes_of(shapes, itemsize)
        dense = len(set(shapes)) <= 1
        placements.append(OutputPlacement(name, dtype, offset, nbytes, shapes, dense, layout))
        offset = round_up(offset + nbytes, OUTPUT_ALIGN)
    return tuple(placements), offset


@functools.lru_cache(maxsize=256)
def itemsize_of(dtype: str) -> int:
    """Bytes per element of a numpy dtype string (cached: descriptors repeat few dtypes)."""
    try:
        return np.dtype(dtype).itemsize
    except TypeError as error:
        raise ProtocolError(f"dtype {dtype!r} is not a numpy dtype") from error


def check_fits(placements: Sequence[OutputPlacement], slot_size: int) -> None:
    """Raise :class:`ProtocolError` unless every placement's bytes lie inside a ``slot_size``
    slot and match its dtype and shapes, so no view made from it can reach past its slot.

    A dense placement is viewed as ``len(shapes)`` samples of ``shapes[0]``; that is what is
    checked (O(1)); a ragged one is viewed sample by sample, so every shape counts.
    """
    for placement in placements:
        itemsize = itemsize_of(placement.dtype)
        if placement.offset < 0 or placement.offset + placement.nbytes > slot_size:
            raise ProtocolError(
                f"output {placement.name!r} ({placement.offset}+{placement.nbytes} bytes) "
                f"does not fit a slot of {slot_size} bytes"
            )
        shapes = placement.shapes
        if placement.dense:
            first = shapes[0] if shapes else ()
            negative = any(d < 0 for d in first)
            expected = len(shapes) * math.prod(first) * itemsize
        else:
            negative = any(d < 0 for shape in shapes for d in shape)
            expected = nbytes_of(shapes, itemsize)
        if negative:
            raise ProtocolError(f"output {placement.name!r} has a negative dimension")
        if expected != placement.nbytes:
            raise ProtocolError(
                f"output {placement.name!r} claims {placement.nbytes} bytes but its shapes "
                f"hold {expected}"
            )


def sample_offsets(placement: OutputPlacement, itemsize: int) -> list[int]:
    """Byte offset (inside the slot) of every sample of a placement."""
    offsets = []
    position = placement.offset
    for shape in placement.shapes:
        offsets.append(position)
        position += math.prod(shape) * itemsize
    return offsets
