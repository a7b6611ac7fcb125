"""Many small reads at once (the index command's footers and small shards): :func:`read_each`.

On an asynchronous fsspec filesystem (s3fs, gcsfs, HTTP) every read runs on the filesystem's own
event loop, ``at_once`` in flight: no thread per read handing each one to the loop and waiting
for it, which cost the index command about as much CPU as the request itself over 10,000 files
(:mod:`bench.index_scale`). Transient failures are tried again as :meth:`RemoteStorage.retried`
tries them (the same decision, :meth:`RemoteStorage.after_failure`, with an asynchronous sleep).
Other stores (local files, synchronous filesystems) are read from ``at_once`` threads.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ._failures import Identity, IdentityChanged
from ._storage import BACKOFF, Storage

__all__ = ["read_each"]


def read_each(
    storage: Storage,
    reads: Sequence[tuple[str, int, int]],
    at_once: int,
    expect: Sequence[Identity] | None = None,
) -> Iterator[tuple[int, bytes | Exception]]:
    """Each of ``reads`` (a URL, and the byte range ``[start, end)`` of it), ``at_once`` in
    flight, as (its number in ``reads``, its bytes or the error it ended in), in the order they
    finish. The errors are those :meth:`Storage.read` raises (``EOFError`` for a short read).
    ``expect``: each object's identity, checked where the read tells it (S3: the GET's ETag and
    size; ``IdentityChanged`` when it differs)."""
    if not reads:
        return
    fs = getattr(storage, "fs", None)
    loop = getattr(fs, "loop", None)
    if fs is None or not getattr(fs, "async_impl", False) or loop is None:
        yield from _threaded(storage, reads, at_once, expect)
        return
    done: queue.SimpleQueue[tuple[int, bytes | Exception]] = queue.SimpleQueue()

    async def one(number: int, gate: asyncio.Semaphore) -> None:
        url, start, end = reads[number]
        async with gate:
            try:
                identity = expect[number] if expect is not None else None
                found: bytes | Exception = await _read(storage, fs, url, start, end, identity)
            except Exception as error:  # (handed to the caller, as a thread's would be)
                found = error
        done.put((number, found))

    async def run() -> None:
        gate = asyncio.Semaphore(max(1, at_once))
        await asyncio.gather(*(one(number, gate) for number in range(len(reads))))

    future = asyncio.run_coroutine_threadsafe(run(), loop)
    try:
        for _ in range(len(reads)):
            yield done.get()
        future.result()
    finally:
        future.cancel()


async def _read(
    storage: Any, fs: Any, url: str, start: int, end: int, expect: Identity | None = None
) -> bytes:
    what = f"reading bytes {start}-{end}"
    delay = BACKOFF
    told = expect is not None and storage.read_tells(expect)
    for attempt in range(storage.retries + 1):
        try:
            data: bytes
            if told:
                data, found = await storage.s3_get(url, start, end)
            else:
                data = await fs._cat_file(url, start=start, end=end)
            break
        except Exception as error:
            storage.after_failure(error, attempt, delay, what, url)
            await asyncio.sleep(delay)
            delay *= 2
    if told and found != expect:
        assert expect is not None
        raise IdentityChanged(url, expect, found)
    if len(data) != end - start:
        raise EOFError(
            f"{url} gave {len(data)} bytes at {start}, not {end - start}: the object was "
            "truncated or replaced since it was listed"
        )
    return data


def _threaded(
    storage: Storage,
    reads: Sequence[tuple[str, int, int]],
    at_once: int,
    expect: Sequence[Identity] | None = None,
) -> Iterator[tuple[int, bytes | Exception]]:
    def read(number: int) -> tuple[int, bytes | Exception]:
        url, start, end = reads[number]
        identity = expect[number] if expect is not None else None
        try:
            return number, storage.read(url, start, end, expect=identity).tobytes()
        except Exception as error:
            return number, error

    with ThreadPoolExecutor(max(1, min(at_once, len(reads))), "storage-reads") as pool:
        yield from pool.map(read, range(len(reads)))
