"""Packing a batch's outputs into one slot: where each output starts and how big it is.

Runs in the worker (to place outputs) and the trainer (to check a descriptor fits its slot).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ._arena import OUTPUT_ALIGN, round_up
from ._wire import OutputPlacement, Shape


def nbytes_of(shapes: Sequence[Shape], itemsize: int) -> int:
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


def check_fits(placements: Sequence[OutputPlacement], slot_size: int) -> None:
    for placement in placements:
        if placement.offset < 0 or placement.offset + placement.nbytes > slot_size:
            raise RuntimeError(
                f"output {placement.name!r} ({placement.offset}+{placement.nbytes} bytes) "
                f"does not fit a slot of {slot_size} bytes"
            )
