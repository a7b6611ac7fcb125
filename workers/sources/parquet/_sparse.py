"""What pyarrow reads a row group from: :class:`SparseFile`, the byte ranges a row group's read
fetched, handed out as views; and how many rows a record batch of a large row group holds
(:func:`batch_rows`). Runs in the worker."""

from __future__ import annotations

import io
from typing import Any

import numpy as np

__all__ = ["BATCH_BYTES", "SparseFile", "batch_rows"]


#: The bytes of a record batch a large row group is read in: a row group read whole is
#: decoded into one buffer per column, which pyarrow grows by doubling (copying it), so a
#: 90 MB image column took 3.3x its size at its peak; read in batches of about this size,
#: 2x, and no copy when the batches are used.
BATCH_BYTES = 16 << 20


def batch_rows(rows: int, size: int) -> int:
    """The rows of each record batch a row group of ``rows`` rows and ``size`` bytes (the
    requested columns') is read in: all of them up to :data:`BATCH_BYTES`."""
    if size <= BATCH_BYTES or rows <= 1:
        return max(rows, 1)
    return max(1, -(-rows // -(-size // BATCH_BYTES)))


class SparseFile(io.RawIOBase):
    """A read-only file of ``size`` bytes of which only ``pieces`` (start -> bytes) are held:
    what pyarrow reads of a row group. A read outside them raises (the plan said which bytes a
    row group needs), naming the range."""

    def __init__(self, name: str, size: int, pieces: dict[int, np.ndarray[Any, Any]]) -> None:
        super().__init__()
        self.name, self.size, self.pieces, self.position = name, size, pieces, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.position, 2: self.size}[whence]
        self.position = base + offset
        return self.position

    def read(self, size: int | None = -1) -> Any:
        """The next ``size`` bytes as a view of the piece that holds them, not a copy: pyarrow
        keeps the view as its buffer (a copy would hold a row group's bytes twice while it is
        decoded)."""
        end = self.size if size is None or size < 0 else min(self.size, self.position + size)
        if end <= self.position:
            return b""
        start, data = self._piece(end - self.position)
        view = data[self.position - start : end - start].data
        self.position = end
        return view

    def readinto(self, buffer: Any) -> int:
        want = min(len(buffer), max(0, self.size - self.position))
        if want == 0:
            return 0
        start, data = self._piece(want)
        at = self.position - start
        memoryview(buffer).cast("B")[:want] = data[at : at + want].data
        self.position += want
        return want

    def _piece(self, want: int) -> tuple[int, np.ndarray[Any, Any]]:
        """The piece that holds the ``want`` bytes at the position, and where it starts."""
        for start, data in self.pieces.items():
            if start <= self.position and self.position + want <= start + len(data):
                return start, data
        raise OSError(
            f"{self.name}: bytes {self.position}-{self.position + want} were not read "
            "with the row group (its footer's offsets disagree with its pages)"
        )
