"""Index files: a JSON header and numpy arrays in one file that readers map. Runs in the worker.

The layout: a magic of 8 bytes, the header's length (little-endian uint64), the header (JSON, with
an ``arrays`` entry: the dtype and length of each array, in order), then each array, 8-byte
aligned, little-endian. A file is written under a temporary name and renamed into place, so a
reader never sees a partial one; one that fails any structural check is reported as such
(``ValueError``) and is rebuilt by its owner. :func:`locked` is the ``flock`` that makes one
process build an index while the others wait for it or do other work.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

_PREFIX = 16  # magic and header length


def _aligned(offset: int) -> int:
    return -(-offset // 8) * 8


def write(
    path: Path, magic: bytes, header: dict[str, Any], arrays: Sequence[np.ndarray[Any, Any]]
) -> None:
    """Write ``header`` and ``arrays`` to ``path`` (atomically: a temporary file, renamed)."""
    assert len(magic) == 8
    described = dict(header, arrays=[[a.dtype.str.lstrip("<>|="), len(a)] for a in arrays])
    encoded = json.dumps(described).encode()
    temporary = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(temporary, "wb") as out:
            out.write(magic + len(encoded).to_bytes(8, "little") + encoded)
            written = _PREFIX + len(encoded)
            for array in arrays:
                out.write(b"\0" * (_aligned(written) - written))
                data = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
                out.write(data)
                written = _aligned(written) + len(data)
        os.replace(temporary, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)


def read(
    path: Path, magic: bytes
) -> tuple[dict[str, Any], list[np.ndarray[Any, Any]], mmap.mmap] | None:
    """The header and arrays (views of the mapping, also returned) of the index at ``path``;
    None when there is none; ``ValueError`` when the file is not a whole index."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size < _PREFIX:
            raise ValueError("truncated")
        mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    if mapped[:8] != magic:
        raise ValueError("not an index")
    length = int.from_bytes(mapped[8:_PREFIX], "little")
    if _PREFIX + length > size:
        raise ValueError("truncated")
    header = json.loads(mapped[_PREFIX : _PREFIX + length])
    if not isinstance(header, dict) or not isinstance(header.get("arrays"), list):
        raise ValueError("no arrays in the header")
    arrays = []
    offset = _PREFIX + length
    for dtype, count in header["arrays"]:
        kind = np.dtype(dtype).newbyteorder("<")
        offset = _aligned(offset)
        end = offset + kind.itemsize * int(count)
        if end > size:
            raise ValueError("truncated")
        arrays.append(np.frombuffer(mapped, kind, int(count), offset))
        offset = end
    if offset != size:
        raise ValueError("trailing bytes")
    return header, arrays, mapped


@contextlib.contextmanager
def locked(path: Path, *, wait: bool = True) -> Iterator[bool]:
    """Hold an exclusive ``flock`` on ``path`` (released on exit, or by the kernel when this
    process dies). ``wait=False``: yields False at once when another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)
