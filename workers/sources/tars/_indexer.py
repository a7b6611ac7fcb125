"""Finding or making the index of one tar shard: this node's cache, the ``.idx`` beside the shard,
a scan. Runs in the worker (and in ``python -m loader.tars index``).

:class:`Indexer` looks in the cheapest place first: this node's cached copy
(:func:`sources.tars._index.load_cached`, valid for one identity of the shard), then the ``.idx``
beside the shard (checked against it: :func:`sources.tars._wds_idx.fits` and the last member's
header), then a scan under this node's lock for the shard, whose index is kept in the cache (and
written beside the shard only by an indexer made with ``publish=True``: the index command, a job
asked to publish; once the store refuses it, not tried again by this indexer). An ``.idx``
whose entries no tar can hold (out of order, overlapping) is refused with a warning naming it;
the tar loader checks the rest of it, member by member, as it reads.
:mod:`workers.sources.tars._shards` decides which shards need it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from typing import IO, Any, Literal, cast

from ..storage import CACHE_DIR_ENV, Identity, Storage, local_path, locked
from ._index import (
    TarIndex,
    keep_cached,
    load_cached,
    lock_path,
    scan_bytes,
    scan_whole_samples,
)
from ._wds_idx import fits, format_idx, header_mismatch, idx_url, last_member, parse_idx

#: Shards of at most this many bytes are scanned from one whole GET where the store's reads tell
#: the object's identity (S3): no HEAD first. Larger ones are streamed.
WHOLE_SCAN_BYTES = 256 << 20

logger = logging.getLogger("workers")

Source = Literal["cache", "idx", "scan"]


def index_command(urls: str | Iterable[str], *, force: bool = False) -> str:
    """The command that indexes these shards once, for every node and job (``force``: scanning
    them again, whatever their ``.idx`` and summary say)."""
    shown = urls if isinstance(urls, str) else " ".join(list(urls)[:3]) + " ..."
    return f"python -m loader.tars index '{shown}'" + (" --force" if force else "")


class Indexer:
    """Finds or makes the index of a shard: this node's cache, the ``.idx`` beside the shard, a
    scan (whose index is then kept in this node's cache; with ``publish``, also written beside
    the shard, where the store allows it)."""

    def __init__(
        self,
        storage: Storage,
        *,
        skip_damaged: bool = False,
        publish: bool = False,
        inline_max: int = 0,
    ) -> None:
        self.storage = storage
        #: write the indexes it makes beside their shards (reading never does unless asked)
        self.publish = publish
        #: with ``publish``, an index whose ``.idx`` text is at most this long is not written
        #: beside its shard but kept in :attr:`inlined`, for the summary (the index command)
        self.inline_max = inline_max
        #: url -> ``.idx`` text of the indexes kept for the summary
        self.inlined: dict[str, str] = {}
        #: a shard that is not whole gives the index of its samples before the damage (its
        #: ``damage`` says what is wrong; kept in this node's cache only) instead of raising
        #: (``on_error="skip"``)
        self.skip_damaged = skip_damaged
        #: the shards found damaged: url -> the index of their whole samples
        self.damaged: dict[str, TarIndex] = {}
        self.writable = True  # until a write beside the shards is refused
        self._refused: set[str] = set()  # ``.idx`` files found not to fit their shard
        self.scanned = 0
        self.scanned_bytes = 0
        #: bytes read by scans so far, counted as they arrive (on any thread: a progress count,
        #: that a scan of a large shard moves before it is done)
        self.read_bytes = 0
        #: warnings given on other threads than the main one (a worker's log records reach the
        #: trainer from its main thread only), until :meth:`say_unsaid` gives them there
        self._unsaid: deque[str] = deque(maxlen=100)

    def get(
        self,
        url: str,
        identity: Identity,
        *,
        listed: bool | None = None,
        wait: bool = True,
        force: bool = False,
        probe: bool = True,
        publish_cached: bool = False,
        recheck: bool = True,
        scan: bool = True,
    ) -> tuple[TarIndex, Source] | None:
        """The index of ``url`` (whose identity is ``identity``) and where it came from.
        ``listed``: whether the listing showed an ``.idx`` beside it (False: no request for it
        before the lock is held). With ``wait=False``, None when another process of this node
        is indexing the shard. ``force``: scan it whatever exists. ``probe``: check an ``.idx``
        against its shard's last member header (not needed where a summary vouches for it).
        ``publish_cached``: write an index found in this node's cache beside its shard when the
        listing showed none there (an indexer made with ``publish``). ``recheck``: once the lock
        is held, look beside the shard again (another node may have indexed it since the
        listing). ``scan=False``: None rather than a scan when no index is found."""
        found = None if force else self._found(url, identity, listed, probe)
        if found is None and not scan:
            return None
        if found is None:
            with self._lock(url, wait) as held:
                if not held:
                    return None
                again = None if recheck else listed
                found = None if force else self._found(url, identity, again, probe)
                if found is None:
                    index = self._scan(url, identity)
                    if index.damage:  # (kept in this node's cache only: nothing vouches for it)
                        keep_cached(self.storage, index, identity)
                        self._damaged(url, index)
                    else:
                        self.keep(url, index, identity)
                    return index, "scan"
        if publish_cached and self.publish and found[1] == "cache" and listed is False:
            self.keep(url, found[0], identity)
        return found

    def _found(
        self, url: str, identity: Identity, listed: bool | None, probe: bool
    ) -> tuple[TarIndex, Source] | None:
        index = load_cached(self.storage, url, identity)
        if index is not None:
            if index.damage:  # (this node scanned it: it is not whole)
                self._damaged(url, index)
            return index, "cache"
        if listed is False or url in self._refused:
            return None
        index = self.beside(url, identity, probe=probe)
        if index is None:
            return None
        keep_cached(self.storage, index, identity)
        return index, "idx"

    def beside(self, url: str, identity: Identity, *, probe: bool = True) -> TarIndex | None:
        """The index in the ``.idx`` beside ``url`` when there is one that fits the shard (its
        size and, with ``probe``, the header of its last member: one read of 512 bytes)."""
        where = idx_url(url)
        try:
            data = self.storage.read_all(local_path(where))
        except FileNotFoundError:
            return None
        try:
            index = parse_idx(url, where, data)
        except ValueError as error:
            return self._refuse(url, f"ignored {where} ({error}): indexing {url} instead")
        if not fits(index, identity[0]):
            return self._refuse(
                url,
                f"ignored {where}: it does not fit {url} ({identity[0]} bytes; its last member "
                f"ends at byte {index.data_end}), which changed since: indexing it again",
            )
        if probe:
            _name, offset, _size = last_member(index)
            try:
                header = self.storage.read(url, offset - 512, offset).tobytes()
            except EOFError:
                header = b""
            why = header_mismatch(index, header)
            if why is not None:
                return self._refuse(
                    url,
                    f"ignored {where}: {url} changed since it was indexed ({why}): indexing "
                    "it again",
                )
        return index

    def warn(self, message: str) -> None:
        """A warning about an index: logged now on the main thread, else kept for the next
        :meth:`say_unsaid` (which the walk over shards and the tar loader call on it)."""
        if threading.current_thread() is threading.main_thread():
            logger.warning("%s", message)
        else:
            self._unsaid.append(message)

    def say_unsaid(self) -> None:
        """Log the warnings given on other threads since the last call (call it on the main
        thread)."""
        while self._unsaid:
            logger.warning("%s", self._unsaid.popleft())

    def _damaged(self, url: str, index: TarIndex) -> None:
        """A shard that is not whole: raise what is wrong, or (``skip_damaged``) record it."""
        if not self.skip_damaged:
            raise ValueError(index.damage)
        self.damaged[url] = index

    def _refuse(self, url: str, message: str) -> TarIndex | None:
        """Log why the ``.idx`` of ``url`` is not used (once: it is not read again), and the
        command that mends it (a job writes no ``.idx`` unless asked)."""
        self._refused.add(url)
        if not self.publish:
            message += f" ({index_command(url, force=True)} mends {idx_url(url)})"
        self.warn(message)
        return None

    def inline(self, url: str, text: bytes | None) -> str:
        """``text`` (the ``.idx`` of ``url``'s index) kept for the summary in :attr:`inlined`
        when it is at most :attr:`inline_max` bytes long; "" when it is not kept."""
        if text is None or len(text) > self.inline_max:
            return ""
        self.inlined[url] = text.decode()
        return self.inlined[url]

    def keep(self, url: str, index: TarIndex, identity: Identity) -> None:
        """Keep ``index`` in this node's cache and, with :attr:`publish`, write it beside its
        shard as ``.idx`` (where the store allows it) or keep it for the summary
        (:meth:`inline`)."""
        self.keep_text(url, index, identity, format_idx(index) if self.publish else None)

    def keep_text(self, url: str, index: TarIndex, identity: Identity, text: bytes | None) -> None:
        """:meth:`keep` with the index's ``.idx`` ``text`` made already."""
        wrote = False
        inline = bool(self.inline(url, text))
        if self.publish and text is None:
            logger.info("%s has a member name with white space: its index stays in the cache", url)
        elif text is not None and not inline and self.writable:
            where = idx_url(url)
            try:
                self.storage.write(local_path(where), text)
                wrote = True
            except OSError as error:
                self.writable = False
                logger.info(
                    "cannot write %s (%s): indexes stay in this node's cache (%s); "
                    "indexing with write access (%s) makes them once for every node",
                    where,
                    error,
                    CACHE_DIR_ENV,
                    index_command(url),
                )
        if not keep_cached(self.storage, index, identity) and not wrote and not inline:
            logger.warning(
                "no writable place for the index of %s: it is made again by every worker at "
                "every start; set %s to a writable directory, or index the dataset once (%s)",
                url,
                CACHE_DIR_ENV,
                index_command(url),
            )

    @contextlib.contextmanager
    def _lock(self, url: str, wait: bool) -> Iterator[bool]:
        try:
            path = lock_path(self.storage, url)
        except OSError:  # no cache directory: no lock (a shard may be scanned twice)
            yield True
            return
        with locked(path, wait=wait) as held:
            yield held

    def _scan(self, url: str, identity: Identity) -> TarIndex:
        """Index the shard from its bytes. On S3, a shard of at most :data:`WHOLE_SCAN_BYTES`
        is read whole with one GET, whose ETag and size must be the ``identity`` it is indexed
        as (a shard replaced since it was listed raises ``IdentityChanged`` naming it); else
        it is streamed."""
        started = time.monotonic()
        storage = self.storage
        if not storage.local and storage.read_tells(identity) and identity[0] <= WHOLE_SCAN_BYTES:
            data = storage.read(url, 0, identity[0], expect=identity)
            self.read_bytes += len(data)
            index, _damage = scan_bytes(url, data.tobytes())
        else:
            with storage.open(local_path(url)) as stream:
                counted = cast(IO[bytes], _Counted(stream, self))
                index, _damage = scan_whole_samples(
                    url, counted, seekable=storage.local, size=identity[0]
                )
        self.scanned += 1
        self.scanned_bytes += identity[0]
        logger.info(
            "indexed %s: %d samples in %.2f s", url, index.samples, time.monotonic() - started
        )
        return index


class _Counted:
    """A stream whose reads count into ``indexer.read_bytes`` (progress of a scan)."""

    def __init__(self, stream: IO[bytes], indexer: Indexer) -> None:
        self._stream, self._indexer = stream, indexer

    def read(self, size: int = -1) -> bytes:
        data = self._stream.read(size)
        self._indexer.read_bytes += len(data)
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)
