"""``sharded_tars``: a sharded source over WebDataset tar shards. Runs in the worker.

The shards are local paths or fsspec URLs (``s3://bucket/train-{000000..000127}.tar``). Each has an
index (:mod:`sources.tars._index`: keys, member offsets and sizes; DALI's ``.idx`` beside the shard)
and the directory a summary of them all (:mod:`sources.tars._shards` opens them), so the dataset's
sample count is known before the first batch and a sample is read by its byte range: every
guarantee of ``sharded_source`` holds (exactly once per epoch, equal steps per rank, resume and
reshard, healing, skipping). A worker fetches the index of a shard when it is about to read it.

Sample ids number the samples shard after shard, in tar order. An epoch's order is the plan's
own permutation of all of them (local shards: each sample is one ``pread`` of its members'
bytes) or, for remote shards, :class:`~._order.TarOrder`'s shuffle within groups of a few
shards; a worker then reads of each shard one contiguous piece, fetched ahead by
:class:`~._fetch.Fetcher` with one request per piece, never one per sample.

Outputs: one per requested extension, in order (:mod:`~._members`): the member's raw bytes (a
uint8 array, for DALI's decoders), or for ``cls``-like members their text parsed as an integer;
an optional member a sample lacks gives its default; ``__key__`` and ``__url__`` the sample's
key and shard. ``ext`` entries may list alternatives: ``"jpg;png"`` takes whichever the sample
has.
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ...spec import Shard
from ..files import MAX_IMAGE_PIXELS, ImageTooLargeError, checked_limit, over_limit
from ..plan import (
    SKIP_DAMAGED,
    Defaulted,
    MemberMissing,
    OpenedOnce,
    OpenedSource,
    SampleLeftOut,
)
from ..storage import AHEAD_BYTES, Identity, IdentityChanged, StorageFailure, storage_failure
from ._changed import changed_answer
from ._fetch import Fetcher
from ._index import TarIndex
from ._indexer import Indexer, index_command
from ._members import Members, parse_ext
from ._order import TarOrders
from ._shards import TarShards, open_shards
from ._wds_idx import idx_url, member_mismatch

__all__ = ["REMOTE_WINDOW", "TarLoader", "open_tar_source"]

logger = logging.getLogger("workers")

#: Shards whose samples a remote epoch shuffles together, by default.
REMOTE_WINDOW = 4
#: Tar indexes a worker keeps open.
_OPEN_INDEXES = 32
#: Bytes of a tar member's header, just before its data.
_HEADER = 512

_Int64s = np.ndarray[Any, np.dtype[np.int64]]


class _Checked:
    """Of a tar index from an ``.idx``: the samples whose members' headers were found to agree
    with it, and where each sample's members start in its arrays."""

    def __init__(self, table: TarIndex) -> None:
        self.table = table
        self.seen = bytearray(table.samples)
        self.starts: list[int] = table.member_starts.tolist()


class TarLoader:
    """``load(index)`` of :func:`sharded_tars`: the sample's members, one output per extension.
    A shard's index is fetched when the shard is about to be read (and the last
    :data:`_OPEN_INDEXES` are kept)."""

    def __init__(
        self,
        shards: TarShards,
        ext: Sequence[Sequence[str]],
        ahead: int,
        members: Members | Sequence[str],
        ahead_bytes: int | None = AHEAD_BYTES,
        max_pixels: int | None = MAX_IMAGE_PIXELS,
    ) -> None:
        if not isinstance(members, Members):  # (the outputs' names: every member required)
            members = Members(ext)
        self.shards, self.ext, self.members = shards, [list(e) for e in ext], members
        self.names = members.names
        #: members that are images decoding to more pixels raise (None: no limit)
        self.max_pixels = max_pixels
        self._indexer = Indexer(shards.storage, publish=shards.publish)
        self._tables: OrderedDict[int, tuple[TarIndex, _Int64s, _Int64s]] = OrderedDict()
        self._making: dict[int, threading.Lock] = {}
        self._lock = threading.Lock()
        #: per shard whose index came from an ``.idx``: the samples whose members' headers were
        #: found to agree with it (:meth:`_read_checked`)
        self._checked: dict[int, _Checked] = {}
        self._fetcher = (
            None
            if shards.storage.local
            else Fetcher(self._fetch, ahead, ahead_bytes, self._piece_bytes)
        )
        self._starts: list[int] = shards.starts.tolist()
        #: on_error="skip": a shard found truncated when it is read gives its whole samples
        self._skip = SKIP_DAMAGED.get()
        #: shards a read found changed since the summary vouched for them, taken as they are
        #: now (:meth:`_changed_on_read`): the identity reads expect, the bytes that hold what
        #: the epoch reads of them, and (truncated) how many of its planned samples are whole
        self._changed: dict[int, tuple[Identity, int, int | None]] = {}
        self._changing = threading.Lock()

    def _held(self, shard: int) -> tuple[TarIndex, _Int64s, _Int64s] | None:
        """The table of ``shard`` if it is held (marked as the latest used)."""
        with self._lock:
            found = self._tables.get(shard)
            if found is not None:
                self._tables.move_to_end(shard)
            return found

    def _keep(self, shard: int, table: tuple[TarIndex, _Int64s, _Int64s]) -> None:
        """Hold ``table`` for ``shard`` (the first one made wins), the last
        :data:`_OPEN_INDEXES` only."""
        with self._lock:
            self._tables.setdefault(shard, table)
            self._tables.move_to_end(shard)
            while len(self._tables) > _OPEN_INDEXES:
                self._tables.popitem(last=False)

    def _table(self, shard: int) -> tuple[TarIndex, _Int64s, _Int64s]:
        found = self._held(shard)
        if found is not None:
            return found
        with self._lock:
            making = self._making.setdefault(shard, threading.Lock())
        with making:  # one fetch of an index, whichever thread asks first
            with self._lock:
                found = self._tables.get(shard)
            if found is not None:
                return found
            try:
                index = self.shards.index(shard, self._indexer)
            except StorageFailure:
                raise
            except (OSError, EOFError) as error:
                raise storage_failure(self.shards.urls[shard], error) from error
            offsets, sizes = index.table(self.ext)
            self._keep(shard, (index, offsets, sizes))
            with self._lock:
                self._making.pop(shard, None)
        return index, offsets, sizes

    def describe(self, index: int) -> str:
        """``<tar>:<key>`` of sample ``index``."""
        shard = int(self.shards.shard_of(np.array([index]))[0])
        table, _offsets, _sizes = self._table(shard)
        return f"{self.shards.urls[shard]}:{table.key(index - int(self.shards.starts[shard]))}"

    def __call__(self, index: int) -> tuple[np.ndarray[Any, Any], ...]:
        shard = bisect.bisect_right(self._starts, index) - 1
        sample = index - self._starts[shard]
        url = self.shards.urls[shard]
        held = self._held(shard)
        if held is None and self._fetcher is not None:  # (a whole shard's fetch brings its
            self._fetcher.wait(shard)  # index: waited for, not fetched beside it)
        table, offsets, sizes = held or self._table(shard)
        # (Python lists from here: numpy's per-call cost is most of a sample's on small rows)
        row_offsets, row_sizes = offsets[sample].tolist(), sizes[sample].tolist()
        members, defaulted = self.members, []
        for column, size in enumerate(row_sizes):
            if size < 0 and members.kinds[column] == "member":
                if column not in members.defaults:
                    _missing(url, table, sample, self.ext[column], self.names[column])
                defaulted.append(self.names[column])
        present = [
            (offset, size) for offset, size in zip(row_offsets, row_sizes, strict=True) if size >= 0
        ]
        start = min((offset for offset, _size in present), default=0)
        end = max((offset + size for offset, size in present), default=0)
        self._left_out(shard, table, sample)
        if not present:
            data = np.empty(0, np.uint8)
        elif table.scanned:
            data = self._read(shard, url, start, end)
        else:
            if self.shards.vouched and self.shards.vouched[shard] is not None:
                # (not yet confirmed by a read: a change found first, past the damage not read)
                self._read(shard, url, start, min(end, start + 1))
                self._left_out(shard, table, sample)
            checked = self._read_checked(shard, table, sample, start, end)
            if checked is None:  # (its .idx lied: the shard was indexed from its own bytes)
                return self(index)
            data = checked
        self._left_out(shard, table, sample)
        outputs = members.outputs(
            row_offsets,
            row_sizes,
            data,
            start,
            (table.key(sample), url),
            lambda member, offset: self._check_pixels(member, table, sample, offset),
        )
        return Defaulted(outputs, defaulted) if defaulted else tuple(outputs)

    def _left_out(self, shard: int, table: TarIndex, sample: int) -> None:
        """A ``ValueError`` (skipped, under ``on_error="skip"``) for a planned sample of a shard
        found truncated when it was read, past its whole samples (:meth:`_changed_on_read`)."""
        changed = self._changed.get(shard)
        if changed is not None and changed[2] is not None and sample >= changed[2]:
            raise SampleLeftOut(
                f"{self.shards.urls[shard]}: sample {table.key(sample)!r} is left out: the shard "
                f"was truncated since it was indexed (its first {changed[2]} samples are whole)",
                self.shards.urls[shard],
                changed[2],
            )

    def _check_pixels(
        self, member: np.ndarray[Any, Any], table: TarIndex, sample: int, offset: int
    ) -> None:
        """Raise :class:`ImageTooLargeError`, naming the member, when it is an image over the
        pixel limit (read from its header)."""
        size = over_limit(member, self.max_pixels)
        if size is None:
            return
        assert self.max_pixels is not None
        ext = table.exts[int(table.member_ext[table.member_offset == offset][0])]
        name = f"{table.url}:{table.key(sample)}.{ext}"
        raise ImageTooLargeError.of(name, size, self.max_pixels, "sharded_tars or TarsDataset")

    def _read_checked(
        self, shard: int, table: TarIndex, sample: int, start: int, end: int
    ) -> np.ndarray[Any, Any] | None:
        """Bytes ``[start, end)`` of ``shard`` (its members of ``sample``), whose index
        ``table`` came from an ``.idx``: the first time a sample is read, with the 512 bytes
        before, so that each of its members read has its own header in the bytes read (no other
        request), checked against its entry. None when one is not: the ``.idx`` lied, and the
        shard was indexed again from its own bytes (:meth:`_rebuild`)."""
        url = self.shards.urls[shard]
        with self._lock:
            checked = self._checked.get(shard)
            if checked is None or checked.table is not table:
                checked = self._checked[shard] = _Checked(table)
                for other in [k for k in self._checked if k not in self._tables]:
                    del self._checked[other]  # (only those of the indexes held)
        if checked.seen[sample]:
            return self._read(shard, url, start, end)
        first = max(0, start - _HEADER)
        data = self._read(shard, url, first, end)
        members = slice(checked.starts[sample], checked.starts[sample + 1])
        key = table.key(sample)
        rows = zip(
            table.member_ext[members].tolist(),
            table.member_offset[members].tolist(),
            table.member_size[members].tolist(),
            strict=True,
        )
        for ext, offset, size in rows:
            if offset < start or offset + size > end:
                continue  # (a member not read: its header is not either)
            name = f"{key}.{table.exts[ext]}"
            header = data[offset - _HEADER - first : offset - first].tobytes()
            why = member_mismatch(header, name, size)
            if why is not None:
                self._rebuild(
                    shard, table, f"{name!r} listed at byte {offset} ({size} bytes): {why}"
                )
                return None
        checked.seen[sample] = 1
        return data[start - first :]

    def _rebuild(self, shard: int, table: TarIndex, why: str) -> None:
        """The index ``table`` of ``shard``, from its ``.idx``, disagrees with the tar
        (``why``): say so, index the shard from its own bytes (its ``.idx`` written again,
        where the store allows it) and hold that index instead. A ``StorageFailure`` names the
        ``.idx`` (or the summary) when the epochs were planned with what it wrongly says."""
        url, where = self.shards.urls[shard], idx_url(self.shards.urls[shard])
        with self._lock:
            making = self._making.setdefault(shard, threading.Lock())
        with making:
            with self._lock:
                held = self._tables.get(shard)
            if held is not None and held[0] is not table and held[0].scanned:
                return  # (another thread did it)
            self._indexer.warn(
                f"{where} does not describe {url}: {why}. It is not used: the shard is indexed "
                f"from its own bytes ({index_command(url, force=True)} mends {where})"
            )
            try:
                found = self._indexer.get(url, self.shards.identities[shard], force=True)
            except StorageFailure:
                raise
            except (OSError, EOFError) as error:
                raise storage_failure(url, error) from error
            except ValueError as error:  # (a shard the .idx called whole is not)
                raise StorageFailure(f"{error} (where {where} calls it whole)") from error
            assert found is not None
            index = found[0]
            if not self.shards.agrees(shard, index):
                raise self.shards.mismatch(shard, index, told_by=where)
            with self._lock:
                self._tables[shard] = (index, *index.table(self.ext))
                self._tables.move_to_end(shard)
                self._checked.pop(shard, None)
                self._making.pop(shard, None)

    def _read(self, shard: int, url: str, start: int, end: int) -> np.ndarray[Any, Any]:
        try:
            if self._fetcher is not None:
                fetched = self._fetcher.get(shard, start, end)
                if fetched is not None:
                    return fetched
            return self._checked_read(shard, start, end)
        except StorageFailure:
            raise
        except (OSError, EOFError) as error:
            raise storage_failure(url, error) from error

    def _checked_read(self, shard: int, start: int, end: int) -> np.ndarray[Any, Any]:
        """Bytes of ``shard``, read checking (remote shards) that the store still has it as the
        epoch was planned: free on S3 (the GET's ETag and size); elsewhere, for a shard known
        from the summary only, one HEAD first. A changed shard is a ``StorageFailure`` naming
        it (:meth:`TarShards.changed`)."""
        shards = self.shards
        identity = shards.identities[shard]
        vouched = shards.vouched[shard] if shards.vouched else None
        changed = self._changed.get(shard)
        if changed is not None:  # (as it is now: read what of it holds the epoch's samples)
            identity, usable = changed[0], changed[1]
            data = shards.storage.read(shards.urls[shard], start, max(start, min(end, usable)))
            if len(data) < end - start:  # (rows past the damage raise before they use these)
                data = np.concatenate([data, np.zeros(end - start - len(data), np.uint8)])
            return data
        check = not shards.storage.local and (
            vouched is not None or shards.storage.read_tells(identity)
        )
        try:
            data = shards.storage.read(
                shards.urls[shard], start, end, expect=identity if check else None
            )
        except IdentityChanged as error:
            self._changed_on_read(shard, error.found, vouched)
            return self._checked_read(shard, start, end)
        except FileNotFoundError as error:
            if vouched is None:
                raise
            raise StorageFailure(
                f"{error.strerror or error}: removed since the summary {vouched} that names "
                "it was written; take it out of the job's shards (or put it back)"
            ) from error
        if vouched is not None:
            shards.vouched[shard] = None  # (the store confirmed it)
        return data

    def _changed_on_read(self, shard: int, found: Identity, vouched: str | None) -> None:
        """A read found ``shard`` other than the summary ``vouched`` says: taken as it is now,
        or an error (:func:`~._changed.changed_answer`)."""
        with self._changing:
            if shard not in self._changed:
                self._changed[shard] = changed_answer(
                    self.shards,
                    shard,
                    found,
                    vouched,
                    lambda: self._table(shard)[0],
                    self._skip,
                    self._indexer,
                )

    def _fetch(self, shard: int, rows: _Int64s) -> tuple[int, np.ndarray[Any, Any]]:
        """(start, bytes) of the range of ``shard`` that holds ``rows`` (on a fetch thread). A
        worker that reads every sample of the shard reads it whole, with one request, and
        indexes it from those bytes (what the summary says of it checked): no ``.idx`` to fetch
        first. Otherwise the shard's index first, then the rows' byte range."""
        if self._held(shard) is None and len(rows) >= int(self.shards.counts[shard]) > 0:
            data = self._checked_read(shard, 0, self.shards.identities[shard][0])
            index = self.shards.index_of_bytes(shard, data)
            if index is not None:
                self._keep(shard, (index, *index.table(self.ext)))
                return 0, data
        _table, offsets, sizes = self._table(shard)
        ends = np.where(sizes[rows] < 0, 0, offsets[rows] + sizes[rows])
        # (from the first member's header: an index from an .idx is checked against it)
        begins = np.where(offsets[rows] < 0, np.iinfo(np.int64).max, offsets[rows] - _HEADER)
        start, end = max(0, int(begins.min())), int(ends.max())
        if end <= start:  # (no row has any wanted member: the loads raise, naming them)
            return 0, np.empty(0, dtype=np.uint8)
        return start, self._checked_read(shard, start, end)

    def _piece_bytes(self, shard: int, rows: _Int64s) -> int:
        """The bytes ``rows`` of ``shard`` are expected to take (its size, pro rata: known
        before its index is)."""
        samples = max(1, int(self.shards.counts[shard]))
        return self.shards.identities[shard][0] * min(len(rows), samples) // samples

    def expect(self, epoch: int, ids: Sequence[np.ndarray[Any, Any]]) -> None:
        """The epoch's batches (sample ids per step): plan the fetches (remote shards only)."""
        if self._fetcher is None or not ids:
            return
        flat = np.concatenate([np.asarray(chunk, dtype=np.int64) for chunk in ids])
        steps = np.repeat(np.arange(len(ids)), [len(chunk) for chunk in ids])
        shards = self.shards.shard_of(flat)
        needs = []
        order = np.unique(shards, return_index=True)
        for shard in order[0][np.argsort(order[1])].tolist():
            chosen = shards == shard
            rows = flat[chosen] - int(self.shards.starts[shard])
            first, last = int(steps[chosen].min()), int(steps[chosen].max())
            needs.append((shard, first, last, rows))
        self._fetcher.plan(needs)

    def passed(self, epoch: int, step: int) -> None:
        if self._fetcher is not None:
            self._fetcher.passed(step)
        self._indexer.say_unsaid()  # (what loads and fetches found, from the main thread)

    def __del__(self) -> None:
        fetcher = getattr(self, "_fetcher", None)
        if fetcher is not None:
            fetcher.close()


#: The shards this process opened last, with the arguments it opened them with.
_opened: OpenedOnce[TarShards] = OpenedOnce()
_How = tuple[int, bool]


def _missing(url: str, table: TarIndex, sample: int, wanted: list[str], name: str) -> None:
    """Raise the ``ValueError`` (a skip, under ``on_error="skip"``) of a sample that lacks a
    required member (``wanted``: its alternatives)."""
    has = sorted(table.exts[int(e)] for e in table.member_ext[table.member_sample == sample])
    raise MemberMissing(
        f"{url}: sample {table.key(sample)!r} has no {' or '.join('.' + e for e in wanted)} "
        f"member (it has {', '.join('.' + e for e in has) or 'none'}); a member some samples "
        f"lack can be optional: optional={{{name!r}: default}}",
        name,
    )


def _open_shards_once(
    urls: str | os.PathLike[str] | Sequence[str],
    storage_options: dict[str, Any] | None,
    shard: Shard,
    how: _How,
) -> TarShards:
    """:func:`open_shards` for this worker's ``shard``, once per worker and arguments (``how``:
    the retries, and whether to publish the indexes made beside the shards; see
    :class:`~workers.sources.plan.OpenedOnce`): a source built again keeps the shards opened at
    the worker's start, instead of reading the summary and expanding the names again (0.1-0.2 s
    at 10,000 shards)."""
    retries, publish = how
    given = os.fspath(urls) if isinstance(urls, os.PathLike) else urls
    names = given if isinstance(given, str) else tuple(given)
    return _opened.get(
        (names, shard.index, shard.count, how),
        storage_options,
        lambda: open_shards(
            given,
            storage_options,
            shard.index / max(1, shard.count),
            retries,
            lead=shard.index == 0,
            skip_damaged=SKIP_DAMAGED.get(),
            publish=publish,
        ),
    )


def open_tar_source(
    shard: Shard,
    urls: str | os.PathLike[str] | Sequence[str],
    *,
    ext: str | Sequence[str],
    storage_options: dict[str, Any] | None,
    shuffle_window: int | None,
    ahead: int,
    retries: int,
    seed: int,
    shuffle: bool,
    ahead_bytes: int | None = AHEAD_BYTES,
    max_image_pixels: int | None = MAX_IMAGE_PIXELS,
    optional: Mapping[str, Any] | None = None,
    publish_index: bool = False,
) -> OpenedSource:
    """Check the arguments, open (index) the shards and make the loader and epoch orders."""
    wanted = parse_ext(ext)
    members = Members(wanted, optional)
    max_pixels = checked_limit(max_image_pixels)
    checked = [("retries", retries, 0), ("ahead", ahead, 0)]
    if ahead_bytes is not None:
        checked.append(("ahead_bytes", ahead_bytes, 0))
    for name, value, low in checked:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if shuffle_window is not None and (
        isinstance(shuffle_window, bool)
        or not isinstance(shuffle_window, int)
        or shuffle_window < 1
    ):
        raise ValueError(f"shuffle_window must be None or an integer >= 1, got {shuffle_window!r}")
    shards = _open_shards_once(urls, storage_options, shard, (retries, bool(publish_index)))
    window = shuffle_window
    if window is None:
        window = len(shards.urls) if shards.storage.local else REMOTE_WINDOW
    window = min(window, len(shards.urls))
    fingerprint = shards.fingerprint()
    orders = None
    if shuffle and window < len(shards.urls):
        fingerprint += f"+window{window}"
        orders = TarOrders(shards, seed, window)
    names = members.names
    load = TarLoader(shards, wanted, ahead, members, ahead_bytes, max_pixels)
    return OpenedSource(
        shards.total,
        load,
        len(wanted),
        fingerprint,
        tuple(names),
        orders,
        load.describe,
        parts=shards.parts(),
        left_out=shards.left_out(),
    )
