"""This loader's step in :mod:`bench.anchors`, in a module of its own that names DALI through
``from loader import ndd`` (the lazy form): the trainer that imports it imports no DALI; the
workers, which call it, import DALI as usual. (:mod:`bench._anchor_runs` stays importable in the
anchors' environment, which has neither DALI nor this package.)"""

from __future__ import annotations

from typing import Any

from loader import ndd

SIZE = 64


def loader_step(jpegs: Any, cls: Any, ids: Any) -> dict[str, Any]:
    """Decode each JPEG and resize it to SIZE x SIZE; the label and the id as int64."""
    images = ndd.decoders.image(jpegs, device="cpu")
    return {
        "image": ndd.resize(images, size=[SIZE, SIZE]),
        "label": ndd.cast(cls, dtype=ndd.int64),
        "id": ndd.cast(ids, dtype=ndd.int64),
    }
