"""``sharded_tars``: a sharded source over WebDataset tar shards. Runs in the worker.

The shards are local paths or fsspec URLs (``s3://bucket/train-{000000..000127}.tar``). Each has an
index (:mod:`sources._tar_index`: keys, member offsets and sizes; DALI's ``.idx`` beside the shard)
and the directory a summary of them all (:mod:`sources._tar_shards` opens them), so the dataset's
sample count is known before the first batch and a sample is read by its byte range: every
guarantee of ``sharded_source`` holds (exactly once per epoch, equal steps per rank, resume and
reshard, healing, skipping). A worker fetches the index of a shard when it is about to read it.

Sample ids number the samples shard after shard, in tar order. An epoch's order
(:class:`TarOrder`) is a permutation of all of them, determined by the seed and the epoch:

* ``shuffle_window=None`` (local shards): one permutation of the whole dataset; each sample is one
  ``pread`` of its members' bytes.
* ``shuffle_window=k`` (remote shards: 4 by default): the shards are permuted and their samples
  concatenated; that sequence is cut where each worker's part of the epoch starts and ends (in
  the layout the epoch started with), each part is cut into groups of ``k`` shards (a shard
  that straddles two parts gives each its own piece), and the samples of each group are
  permuted among themselves. A worker reads a few shards at a time, of each one only its own
  contiguous piece, with one request for that byte range (the next shards fetched while the
  current ones are halfway read, at most ``ahead`` in advance and, past the first, at most
  ``ahead_bytes`` of them), never one request per sample:
  an epoch reads each shard's bytes once, however many workers and ranks share it. A sample
  can land anywhere in its group, and the groups come in a random order; a sample never meets,
  in one batch, samples of shards outside its group. Memory per worker: the pieces of the
  groups in use plus what is fetched ahead.

Outputs: one per requested extension, in order: the member's raw bytes (a uint8 array, for DALI's
decoders), or for ``cls``-like members (:data:`INTEGER_EXTS`) their text parsed as an integer.
``ext`` entries may list alternatives: ``"jpg;png"`` takes whichever the sample has.
"""

from __future__ import annotations

import bisect
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from ..spec import Shard
from ._control import SKIP_DAMAGED, STARTED_TOGETHER
from ._epoch_order import EpochOrder, orders_at
from ._image_size import MAX_IMAGE_PIXELS, ImageTooLargeError, checked_limit, over_limit
from ._sampling import OpenedSource
from ._storage import AHEAD_BYTES, Identity, IdentityChanged, StorageFailure, storage_failure
from ._tar_index import TarIndex, scan_bytes
from ._tar_indexer import WHOLE_SCAN_BYTES, Indexer, index_command
from ._tar_shards import TarShards, open_shards
from ._tar_write import write_tars
from ._wds_idx import idx_url, member_mismatch

__all__ = [
    "AHEAD_BYTES",
    "INTEGER_EXTS",
    "REMOTE_WINDOW",
    "StorageFailure",
    "TarLoader",
    "TarOrder",
    "TarOrders",
    "open_shards",
    "open_tar_source",
    "parse_ext",
    "write_tars",
]

logger = logging.getLogger("workers")

#: Extensions whose members are text integers (WebDataset's convention): decoded to int arrays.
INTEGER_EXTS: dict[str, type[np.integer[Any]]] = {
    "cls": np.int32,
    "cls2": np.int32,
    "class": np.int32,
    "label": np.int32,
    "count": np.int64,
    "index": np.int64,
    "inx": np.int64,
    "id": np.int64,
}

#: Shards whose samples a remote epoch shuffles together, by default.
REMOTE_WINDOW = 4
#: Tar indexes a worker keeps open.
_OPEN_INDEXES = 32
#: Bytes of a tar member's header, just before its data.
_HEADER = 512

_Int64s = np.ndarray[Any, np.dtype[np.int64]]


class TarOrder:
    """The samples at positions of one epoch (see the module docstring): shards permuted and
    concatenated, that sequence cut into *parts* (``parts``: the sorted positions where each
    worker's part of the epoch starts and ends, in the layout the epoch started with; None: one
    part), each part cut into groups of ``window`` shards (or pieces of shards, at a part's
    edges), and the samples permuted inside each group. A worker whose part is a run of groups
    then reads of each shard one contiguous range that no other worker reads: an epoch reads
    each shard's bytes once, whatever the number of workers and ranks."""

    def __init__(
        self,
        shards: TarShards,
        epoch: int,
        seed: int,
        window: int,
        parts: np.ndarray[Any, Any] | None = None,
    ) -> None:
        count = len(shards.counts)
        self.shards, self.window, self.epoch, self.seed = shards, window, epoch, seed
        self.permuted: _Int64s = EpochOrder(count, epoch, seed, True).at(np.arange(count))
        #: where each permuted shard's samples start in the sequence, and the total
        self.runs: _Int64s = np.concatenate(
            [np.zeros(1, np.int64), np.cumsum(shards.counts[self.permuted])]
        )
        total = int(self.runs[-1])
        given = np.empty(0, np.int64) if parts is None else np.asarray(parts, np.int64)
        cuts = np.unique(np.clip(np.concatenate([given, [0, total]]), 0, total))
        # pieces: the sequence cut at every shard's start and every part's edge
        pieces = np.unique(np.concatenate([self.runs, cuts]))[:-1]
        part = np.searchsorted(cuts, pieces, side="right") - 1
        first_piece = np.searchsorted(pieces, cuts[part])  # the first piece of each piece's part
        heads = (np.arange(len(pieces)) - first_piece) % window == 0
        #: where each group starts in the sequence, and the total
        self.group_starts: _Int64s = np.concatenate([pieces[heads], [total]]).astype(np.int64)
        self._seeds: dict[int, int] = {}

    def at(self, positions: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        positions = np.asarray(positions, dtype=np.int64)
        groups = np.searchsorted(self.group_starts, positions, side="right") - 1
        # every group's samples permuted by its own order, all groups in one vectorised pass
        found, inverse = np.unique(groups, return_inverse=True)
        firsts = self.group_starts[found]
        sizes = self.group_starts[found + 1] - firsts
        seeds = [self._group_seed(group) for group in found.tolist()]
        starts = firsts[inverse]
        sequence = starts + orders_at(sizes, seeds, self.epoch, inverse, positions - starts)
        # a place in the sequence is a sample of a permuted shard, in tar order
        slot = np.searchsorted(self.runs, sequence, side="right") - 1
        ids: np.ndarray[Any, Any] = self.shards.starts[self.permuted[slot]] + (
            sequence - self.runs[slot]
        )
        return ids

    def _group_seed(self, group: int) -> int:
        """The seed of the order inside ``group`` (kept: an epoch's plan is asked for more than
        once)."""
        seed = self._seeds.get(group)
        if seed is None:
            key = np.random.SeedSequence([self.seed, self.epoch, group]).generate_state(1)
            seed = self._seeds[group] = int(key[0])
        return seed


class TarOrders:
    """``orders(epoch, parts)`` for :class:`BatchedSamples`: the :class:`TarOrder` of each epoch
    (the last two are kept: the worker asks for the current and the next one)."""

    def __init__(self, shards: TarShards, seed: int, window: int) -> None:
        self.shards, self.seed, self.window = shards, seed, window
        self._made: OrderedDict[tuple[int, bytes], TarOrder] = OrderedDict()

    def __call__(self, epoch: int, parts: np.ndarray[Any, Any] | None = None) -> TarOrder:
        key = (epoch, b"" if parts is None else np.asarray(parts, np.int64).tobytes())
        order = self._made.get(key)
        if order is None:
            order = TarOrder(self.shards, epoch, self.seed, self.window, parts)
            self._made[key] = order
            while len(self._made) > 2:
                self._made.popitem(last=False)
        return order


def _decode_int(
    data: np.ndarray[Any, Any], dtype: Any, table: TarIndex, sample: int, ext: str
) -> np.ndarray[Any, Any]:
    text = data.tobytes()
    try:
        return np.array([int(text)], dtype=dtype)
    except ValueError:
        raise ValueError(
            f"{table.url}: {table.key(sample)}.{ext} is not an integer: {text[:40]!r}"
        ) from None


class _Fetcher:
    """Reads the byte ranges a worker's epoch needs of remote shards, on background threads,
    shortly before the samples that need them; a fetch first gets its shard's index.

    A shard is fetched when the batch being loaded needs it, or when it is at most ``lead`` steps
    away, fewer than ``ahead`` fetched shards wait to be needed and (past the first of them) the
    bytes of those waiting and of this one stay within ``ahead_bytes`` (``size(shard, rows)``:
    the bytes its rows are expected to take): a worker's first batch waits only for the shards
    it reads, and the next group's shards come while the current group is halfway read. A
    shard's bytes are dropped once its last batch is loaded.
    """

    def __init__(
        self,
        fetch: Callable[[int, _Int64s], tuple[int, np.ndarray[Any, Any]]],
        ahead: int,
        ahead_bytes: int | None = None,
        size: Callable[[int, _Int64s], int] | None = None,
    ) -> None:
        self.fetch, self.ahead, self.ahead_bytes = fetch, ahead, ahead_bytes
        self.size = size or (lambda _shard, rows: 0)
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._buffers: dict[int, tuple[int, Future[tuple[int, np.ndarray[Any, Any]]]]] = {}
        self._needs: list[tuple[int, int, int, _Int64s]] = []  # shard, first, last step, rows
        self._next = 0
        self._step = -1
        self._lead = 1
        self._kept: dict[int, Future[tuple[int, np.ndarray[Any, Any]]]] = {}

    def plan(self, needs: list[tuple[int, int, int, _Int64s]]) -> None:
        """A new epoch: ``needs`` (shard, first step, last step, its rows read) in the order the
        shards are first needed. A fetch made for the same rows of a shard is kept (an epoch
        planned again, as it is once the first batch has been traced)."""
        with self._lock:
            earlier = {shard: rows for shard, _first, _last, rows in self._needs}
            kept = {}
            for shard, _first, _last, rows in needs:
                held, before = self._buffers.get(shard), earlier.get(shard)
                if held is not None and before is not None and np.array_equal(before, rows):
                    kept[shard] = held[1]
            for shard, (_first, future) in self._buffers.items():
                if shard not in kept:
                    future.cancel()
            self._buffers.clear()
            self._kept = kept
            self._needs, self._next, self._step = needs, 0, -1
            spans = sorted(last - first + 1 for _shard, first, last, _rows in needs)
            self._lead = max(1, spans[len(spans) // 2] // 2) if spans else 1
            if self._pool is None:
                self._pool = ThreadPoolExecutor(4, "tar-fetch")
            self._schedule()

    def passed(self, step: int) -> None:
        with self._lock:
            self._step = step
            for shard, _first, last, _rows in self._needs[: self._next]:
                if last <= step:
                    self._buffers.pop(shard, None)
            if self._pool is not None:
                self._schedule()

    def _schedule(self) -> None:
        assert self._pool is not None
        loading = self._step + 1
        while self._next < len(self._needs):
            shard, first, _last, rows = self._needs[self._next]
            if first > loading and not self._may_fetch_ahead(first, loading, shard, rows):
                return
            future = self._kept.pop(shard, None) or self._pool.submit(self.fetch, shard, rows)
            self._buffers[shard] = (first, future)
            self._next += 1

    def _may_fetch_ahead(self, first: int, loading: int, shard: int, rows: _Int64s) -> bool:
        """Whether ``shard`` (first needed at step ``first``) may be fetched before the step
        ``loading`` needs it (see the class docstring)."""
        if first > loading + self._lead:
            return False
        needs = self._needs[: self._next]
        waiting = [(s, r) for s, f, _l, r in needs if f > loading and s in self._buffers]
        if len(waiting) >= self.ahead:
            return False
        if self.ahead_bytes is None or not waiting:
            return True
        held = sum(self.size(s, r) for s, r in waiting)
        return held + self.size(shard, rows) <= self.ahead_bytes

    def wait(self, shard: int) -> None:
        """Wait for the fetch of ``shard`` if one is under way (its errors are left to
        :meth:`get`)."""
        with self._lock:
            held = self._buffers.get(shard)
        if held is not None:
            wait([held[1]])

    def get(self, shard: int, start: int, end: int) -> np.ndarray[Any, Any] | None:
        """Bytes ``[start, end)`` of ``shard`` if they were fetched (waits for a fetch under
        way); None when they were not."""
        with self._lock:
            held = self._buffers.get(shard)
        if held is None:
            return None
        first, data = held[1].result()
        if start < first or end > first + len(data):
            return None
        return data[start - first : end - first]

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None
            self._buffers.clear()
            self._kept.clear()


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
        names: Sequence[str],
        ahead_bytes: int | None = AHEAD_BYTES,
        max_pixels: int | None = MAX_IMAGE_PIXELS,
    ) -> None:
        self.shards, self.ext, self.names = shards, [list(e) for e in ext], list(names)
        #: members that are images decoding to more pixels raise (None: no limit)
        self.max_pixels = max_pixels
        self._indexer = Indexer(shards.storage)
        self._tables: OrderedDict[int, tuple[TarIndex, _Int64s, _Int64s]] = OrderedDict()
        self._making: dict[int, threading.Lock] = {}
        self._lock = threading.Lock()
        #: per shard whose index came from an ``.idx``: the samples whose members' headers were
        #: found to agree with it (:meth:`_read_checked`)
        self._checked: dict[int, _Checked] = {}
        self._fetcher = (
            None
            if shards.storage.local
            else _Fetcher(self._fetch, ahead, ahead_bytes, self._piece_bytes)
        )
        self._starts: list[int] = shards.starts.tolist()
        self._integers = [INTEGER_EXTS.get(name) for name in self.names]
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
        if min(row_sizes) < 0:
            column = row_sizes.index(min(row_sizes))
            has = sorted(
                table.exts[int(e)] for e in table.member_ext[table.member_sample == sample]
            )
            raise ValueError(
                f"{url}: sample {table.key(sample)!r} has no "
                f"{' or '.join('.' + e for e in self.ext[column])} member (it has "
                f"{', '.join('.' + e for e in has) or 'none'})"
            )
        start = min(row_offsets)
        end = max(offset + size for offset, size in zip(row_offsets, row_sizes, strict=True))
        self._left_out(shard, table, sample)
        if table.scanned:
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
        outputs = []
        for column, (offset, size) in enumerate(zip(row_offsets, row_sizes, strict=True)):
            member = data[offset - start : offset - start + size]
            dtype = self._integers[column]
            if dtype is None:
                self._check_pixels(member, table, sample, offset)
                outputs.append(member)
            else:
                outputs.append(_decode_int(member, dtype, table, sample, self.names[column]))
        return tuple(outputs)

    def _left_out(self, shard: int, table: TarIndex, sample: int) -> None:
        """A ``ValueError`` (skipped, under ``on_error="skip"``) for a planned sample of a shard
        found truncated when it was read, past its whole samples (:meth:`_changed_on_read`)."""
        changed = self._changed.get(shard)
        if changed is not None and changed[2] is not None and sample >= changed[2]:
            raise ValueError(
                f"{self.shards.urls[shard]}: sample {table.key(sample)!r} is left out: the shard "
                f"was truncated since it was indexed (its first {changed[2]} samples are whole)"
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
                f"from its own bytes (and {where} written again where the store allows it)"
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
        or an error (:func:`_changed_answer`)."""
        with self._changing:
            if shard not in self._changed:
                self._changed[shard] = _changed_answer(
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


def _changed_answer(
    shards: TarShards,
    shard: int,
    found: Identity,
    vouched: str | None,
    planned_index: Callable[[], TarIndex],
    skip: bool,
    indexer: Indexer,
) -> tuple[Identity, int, int | None]:
    """A read found ``shard`` other than the summary ``vouched`` (no listing was made) says:
    its bytes now (one GET) decide, as a listing at the start would have (docs/datasets.md,
    errors). Shorter, its whole samples the first ones planned: damaged data, a
    ``ValueError`` naming the shard, where it ends and the stale summary; under
    ``on_error="skip"`` its whole samples are read and the rest left out (each skipped
    where the epoch planned it), with a warning. Longer, the planned samples where they
    were: what the summary covers is read, with a warning. Anything else (rewritten) is a
    ``StorageFailure`` naming the command that indexes it again."""
    url, planned = shards.urls[shard], shards.identities[shard][0]
    if vouched is None or found[0] > WHOLE_SCAN_BYTES:
        raise shards.changed(shard, found)
    table = planned_index()
    try:
        data = shards.storage.read(url, 0, found[0], expect=found)
    except IdentityChanged as error:  # (changed again meanwhile)
        raise shards.changed(shard, error.found) from error
    now, _damage = scan_bytes(url, data.tobytes())
    whole = min(now.samples, table.samples)
    grew = found[0] > planned and whole == table.samples
    if not _same_first(now, table, whole) or (found[0] >= planned and not grew):
        raise shards.changed(shard, found)  # (rewritten: other bytes, other samples)
    mend = "rewrite the shard (or take it out of the job's shards), then run "
    mend += index_command(url)
    if found[0] < planned:
        message = (
            f"{url} is not a whole tar file: it ends at byte {found[0]}, where the summary "
            f"{vouched} that this job planned its epochs with says {planned} (truncated "
            f"since it was indexed: the summary is stale for it); {mend}"
        )
        if not skip:
            raise ValueError(message)
        kept = table.member_sample < whole
        read_to = int((table.member_offset[kept] + table.member_size[kept]).max(initial=0))
        indexer.warn(
            f"on_error='skip': {message}. Its first {whole} samples are read (up to byte "
            f"{read_to} of {found[0]}); the other {table.samples - whole} planned samples "
            "of it are left out of every epoch (each skipped where it was planned)"
        )
        return found, found[0], whole
    indexer.warn(
        f"{url} grew since it was indexed ({planned} -> {found[0]} bytes): the summary "
        f"{vouched} that this job planned its epochs with is stale for it. The "
        f"{table.samples} samples it covers are read, none added since; run "
        f"{index_command(url)} (then restart the job) to read them all"
    )
    return found, found[0], None


def _same_first(now: TarIndex, planned: TarIndex, samples: int) -> bool:
    """Whether the first ``samples`` samples of ``now`` are those of ``planned``: the same keys,
    members and bytes' places."""
    if samples > now.samples or samples > planned.samples:
        return False
    ends = int(now.key_offsets[samples]), int(planned.key_offsets[samples])
    if ends[0] != ends[1] or bytes(now.keys[: ends[0]]) != bytes(planned.keys[: ends[1]]):
        return False
    mine, theirs = now.member_sample < samples, planned.member_sample < samples
    return (
        np.array_equal(now.member_offset[mine], planned.member_offset[theirs])
        and np.array_equal(now.member_size[mine], planned.member_size[theirs])
        and [now.exts[e] for e in now.member_ext[mine].tolist()]
        == [planned.exts[e] for e in planned.member_ext[theirs].tolist()]
    )


#: The shards this process opened last, and the arguments it opened them with.
_last_opened: tuple[Any, TarShards] | None = None


def _open_shards_once(
    urls: str | Sequence[str], storage_options: dict[str, Any] | None, shard: Shard, retries: int
) -> TarShards:
    """:func:`open_shards` for this worker's ``shard``, once per worker and arguments: the
    source built again with the same ones (a resume's seek to its saved position, an epoch left
    early) keeps the shards opened at the worker's start, the set the job's plan was made from,
    instead of reading the summary and expanding the names again (0.1-0.2 s at 10,000 shards).
    A shard changed since is still named when it is read (its identity is checked then).
    Outside a loader's worker (no :data:`STARTED_TOGETHER` token), and with options that do not
    serialize to JSON, the shards are opened every time."""
    global _last_opened
    skip_damaged, pool = SKIP_DAMAGED.get(), STARTED_TOGETHER.get()
    key: Any = None
    if pool:
        try:
            options = json.dumps(storage_options, sort_keys=True)
        except (TypeError, ValueError):
            options = None
        if options is not None:
            names = urls if isinstance(urls, str) else tuple(urls)
            key = (pool, names, options, shard.index, shard.count, retries, skip_damaged)
    last = _last_opened
    if key is not None and last is not None and last[0] == key:
        return last[1]
    shards = open_shards(
        urls,
        storage_options,
        shard.index / max(1, shard.count),
        retries,
        lead=shard.index == 0,
        skip_damaged=skip_damaged,
    )
    _last_opened = None if key is None else (key, shards)
    return shards


def parse_ext(ext: str | Sequence[str]) -> list[list[str]]:
    """``ext`` as a list of alternatives per output (``"jpg;png"`` -> ``["jpg", "png"]``)."""
    items = [ext] if isinstance(ext, str) else list(ext)
    if not items:
        raise ValueError("ext must name at least one extension, e.g. ext=('jpg', 'cls')")
    parsed = []
    for item in items:
        if not isinstance(item, str) or not item.strip(";"):
            raise ValueError(f"ext entries must be extension names like 'jpg', got {item!r}")
        parsed.append([part.lstrip(".") for part in item.split(";") if part])
    return parsed


def open_tar_source(
    shard: Shard,
    urls: str | Sequence[str],
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
) -> OpenedSource:
    """Check the arguments, open (index) the shards and make the loader and epoch orders."""
    wanted = parse_ext(ext)
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
    shards = _open_shards_once(urls, storage_options, shard, retries)
    window = shuffle_window
    if window is None:
        window = len(shards.urls) if shards.storage.local else REMOTE_WINDOW
    window = min(window, len(shards.urls))
    fingerprint = shards.fingerprint()
    orders = None
    if shuffle and window < len(shards.urls):
        fingerprint += f"+window{window}"
        orders = TarOrders(shards, seed, window)
    names = [alternatives[0] for alternatives in wanted]
    load = TarLoader(shards, wanted, ahead, names, ahead_bytes, max_pixels)
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
