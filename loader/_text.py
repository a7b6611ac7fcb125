"""Text members of a delivered batch (captions, keys, JSON) as Python strings. Runs in the
trainer.

A tar's ``.txt``/``.json`` member (and ``__key__``/``__url__``) arrives as the member's bytes,
one uint8 array per row: a list of arrays (rows of different lengths) or one 2-D array (rows of
one length, stacked). :func:`texts` decodes either, numpy, torch or cupy, to ``list[str]``:
the form a tokenizer takes, on the trainer's side of the loader.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np


def _row_bytes(row: Any) -> bytes:
    """One row's bytes: a numpy, torch (any device) or cupy array, or bytes."""
    if isinstance(row, (bytes, bytearray, memoryview)):
        return bytes(row)
    if isinstance(row, np.ndarray):
        return row.tobytes()
    detach = getattr(row, "detach", None)
    if detach is not None:  # torch: to the host first
        return bytes(detach().cpu().numpy().tobytes())
    get = getattr(row, "get", None)
    if get is not None and hasattr(row, "__cuda_array_interface__"):  # cupy
        return bytes(get().tobytes())
    return np.asarray(row).tobytes()


def texts(values: Any, encoding: str = "utf-8", errors: str = "strict") -> list[str]:
    """The rows of a text output of a batch (``batch["txt"]``) as ``list[str]``, one per row,
    in row order: ``captions = loader.texts(batch["txt"])``. ``values``: a list of per-row
    arrays or one 2-D array (numpy, torch or cupy); ``errors`` as for ``bytes.decode``
    (``"replace"`` for text that may not be UTF-8). A row cut with ``cut_padding=True`` is not
    there; without it, rows ``info.replaced`` and the last ``info.padded`` repeat others."""
    if isinstance(values, (str, bytes)):
        raise TypeError("texts() takes a batch's text output (rows of bytes), not one text")
    return [_row_bytes(row).decode(encoding, errors) for row in values]


def jsons(values: Any) -> list[Any]:
    """The rows of a ``.json`` output of a batch, each parsed (:func:`texts`, then
    ``json.loads``)."""
    return [json.loads(text) if text else None for text in texts(values)]
