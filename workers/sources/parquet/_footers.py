"""Parquet footers read once per node: a remote file's footer bytes kept in this node's cache
(``$DALI_LOADER_CACHE_DIR/parquet-footer/``, never beside the data), keyed by the file's URL and
identity (size, version), so that the workers and ranks of a node starting together read each
footer once between them, and a later start reads none. Runs in the worker.

The first process to start takes the node's lock for the set of files, reads the footers missing
from the cache (one ranged read of each file's tail, in parallel) and keeps them; the others wait
for it and find them there. Local files are read where they lie (a ``pread`` of their tail costs
less than the cache). A file rewritten since has another identity, so another key: a footer kept
is never taken for another file's.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..storage import Identity, Storage, cache_dir, locked
from ._arrow import pyarrow_modules

__all__ = [
    "FOOTER_CACHE",
    "footer_from_tail",
    "node_footers_into",
    "parse_footer",
    "read_footer_bytes",
    "tail_range",
]

logger = logging.getLogger("workers")

#: The cache directory's folder that keeps footers.
FOOTER_CACHE = "parquet-footer"
#: Bytes of a file's tail read for its footer at first (most footers fit).
TAIL = 64 << 10
#: Footers read at once.
_THREADS = 16
_MAGIC = b"PAR1"
#: Where a footer found goes: ``put(its file's number, its bytes)``.
Put = Callable[[int, bytes], None]


def read_footer_bytes(storage: Storage, url: str, size: int) -> bytes:
    """The footer (its Thrift bytes) of the Parquet file at ``url`` of ``size`` bytes, from one
    ranged read of its tail (two when the footer is longer); ``ValueError`` naming the file when
    it is not Parquet or its footer is cut."""
    first, _ = tail_range(url, size)
    return footer_from_tail(storage, url, size, storage.read(url, first, size).tobytes())


def tail_range(url: str, size: int) -> tuple[int, int]:
    """The byte range of a file's tail read first for its footer; ``ValueError`` naming the
    file when it is too short to be Parquet."""
    if size < 12:
        raise ValueError(f"{url} is not a Parquet file: {size} bytes, shorter than any")
    return max(0, size - TAIL), size


def footer_from_tail(storage: Storage, url: str, size: int, tail: bytes) -> bytes:
    """The footer of the file at ``url`` from its ``tail`` (:func:`tail_range`), reading the
    bytes before it when the footer is longer; ``ValueError`` as :func:`read_footer_bytes`."""
    first = size - len(tail)
    if tail[-4:] != _MAGIC:
        raise ValueError(
            f"{url} is not a Parquet file (it does not end with PAR1: not Parquet, or truncated)"
        )
    (length,) = struct.unpack("<I", tail[-8:-4])
    if length + 12 > size:
        raise ValueError(
            f"{url}: its Parquet footer says it is {length} bytes long, more than the file "
            f"({size} bytes): the file is truncated or damaged"
        )
    if length + 8 > len(tail):
        head = storage.read(url, size - 8 - length, first).tobytes()
        tail = head + tail
    return tail[len(tail) - 8 - length : len(tail) - 8]


def parse_footer(url: str, footer: bytes) -> Any:
    """The ``pyarrow.parquet.FileMetaData`` of footer bytes; ``ValueError`` naming the file when
    they cannot be read."""
    pa, pq = pyarrow_modules()
    try:
        return pq.read_metadata(
            pa.BufferReader(_MAGIC + footer + struct.pack("<I", len(footer)) + _MAGIC)
        )
    except Exception as error:
        raise ValueError(
            f"{url}: its Parquet footer cannot be read ({type(error).__name__}: {error}): "
            "the file is damaged"
        ) from None


def _key(url: str, identity: Identity) -> str:
    size, version = identity
    text = f"{url}\0{size}\0{version}".encode("utf-8", "surrogateescape")
    return hashlib.sha256(text).hexdigest()[:40]


def _each(read: Callable[[int], bytes], numbers: Sequence[int], put: Put) -> None:
    """``put(number, read(number))`` for each of ``numbers``, read on threads, in order."""
    if len(numbers) <= 1:
        for number in numbers:
            put(number, read(number))
        return
    threads = min(_THREADS, len(numbers))
    with ThreadPoolExecutor(threads, "parquet-footer") as pool:
        pending: deque[tuple[int, Future[bytes]]] = deque()
        for number in numbers:  # (a few reads ahead of the ones put: never all in memory)
            pending.append((number, pool.submit(read, number)))
            if len(pending) >= 2 * threads:
                done, future = pending.popleft()
                put(done, future.result())
        while pending:
            done, future = pending.popleft()
            put(done, future.result())


def _cached(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _keep(path: Path, footer: bytes) -> None:
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    temporary.write_bytes(footer)
    os.replace(temporary, path)


def node_footers_into(
    storage: Storage,
    urls: Sequence[str],
    identities: Sequence[Identity],
    read: Callable[[int], bytes],
    put: Put,
) -> None:
    """``put(number, footer bytes)`` for each of ``urls`` (``read(number)``: the footer bytes of
    file ``number``): read here for local files, through this node's cache for remote ones (see
    the module docstring), one at a time (never all of them in memory at once)."""
    if storage.local:
        _each(read, list(range(len(urls))), put)
    else:
        _through_cache(urls, identities, read, put)


def set_lock(folder: Path, paths: Sequence[Path]) -> Path:
    """The lock of the whole set of files' footers (not of those a process found missing: one
    that started while another was half-way found fewer missing, took another lock, and read
    them again; 3 ranks read 10 footers 19 times)."""
    together = hashlib.sha256("\n".join(path.name for path in paths).encode()).hexdigest()
    return folder / f"{together[:32]}.lock"


def _through_cache(
    urls: Sequence[str], identities: Sequence[Identity], read: Callable[[int], bytes], put: Put
) -> None:
    folder = cache_dir(FOOTER_CACHE)
    keys = [_key(url, ident) for url, ident in zip(urls, identities, strict=True)]
    paths = [folder / f"{key}.footer" for key in keys]
    have: set[int] = set()

    def found(number: int, data: bytes) -> None:
        put(number, data)
        have.add(number)

    for number, path in enumerate(paths):
        data = _cached(path)
        if data is not None:
            found(number, data)
    missing = [number for number in range(len(urls)) if number not in have]
    if not missing:
        return

    def kept(number: int, data: bytes) -> None:
        found(number, data)
        _keep(paths[number], data)

    try:
        folder.mkdir(parents=True, exist_ok=True)
        with locked(set_lock(folder, paths)):
            for number in missing:  # (another process may have read them while this waited)
                data = _cached(paths[number])
                if data is not None:
                    found(number, data)
            _each(read, [number for number in missing if number not in have], kept)
    except OSError as error:  # no cache directory: each process reads its own
        logger.debug("cannot keep Parquet footers in %s (%s)", folder, error)
        _each(read, [n for n in missing if n not in have], found)
