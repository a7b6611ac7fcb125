"""``sharded_tars``: a sharded source over WebDataset tar shards. Runs in the worker.

The shards are local paths or fsspec URLs (``s3://bucket/train-{000000..000127}.tar``). Each has an
index (:mod:`workers._tar_index`: keys, member offsets and sizes, made once and kept), so the
dataset's sample count is known before the first batch and a sample is read by its byte range:
every guarantee of ``sharded_source`` holds (exactly once per epoch, equal steps per rank, resume
and reshard, healing, skipping). A worker holds the index of the shards it reads, not of all.

Sample ids number the samples shard after shard, in tar order. An epoch's order
(:class:`TarOrder`) is a permutation of all of them, determined by the seed and the epoch:

* ``shuffle_window=None`` (local shards): one permutation of the whole dataset; each sample is one
  ``pread`` of its members' bytes.
* ``shuffle_window=k`` (remote shards: 4 by default): the shards are permuted, then taken ``k`` at a
  time, and the samples of each group of ``k`` are permuted among themselves. A worker's part of an
  epoch is a run of such groups, so it reads a few shards at a time, each with one request for the
  byte range it needs (fetched ``ahead`` shards in advance, while earlier ones are decoded), never
  one request per sample. A sample can land anywhere in its group of ``k`` shards' samples, and the
  groups come in a random order; a sample never meets, in one batch, samples of shards outside its
  group. Memory per worker: the shards of the groups in use plus ``ahead`` more.

Outputs: one per requested extension, in order: the member's raw bytes (a uint8 array, for DALI's
decoders), or for ``cls``-like members (:data:`INTEGER_EXTS`) their text parsed as an integer.
``ext`` entries may list alternatives: ``"jpg;png"`` takes whichever the sample has.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import os
import posixpath
import tarfile
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ._epoch_order import EpochOrder
from ._files import list_files, read_file
from ._sampling import BatchedSamples, OpenedSource
from ._shard import Shard
from ._storage import RETRIES, Storage, expand_urls, local_path, storage_for
from ._tar_index import Indexer, TarIndex, open_indexes

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

_Int64s = np.ndarray[Any, np.dtype[np.int64]]


class StorageFailure(OSError):
    """A shard could not be read (missing, denied, unreachable after retries): not a bad sample,
    so ``on_error="skip"`` does not skip it; it stops the worker."""

    _loader_fatal = True


@dataclass
class TarShards:
    """A set of tar shards, opened: their sample counts (and where each one's ids start)."""

    urls: list[str]
    storage: Storage
    counts: _Int64s
    starts: _Int64s  # the first sample id of each shard, and the total
    keys_hashes: list[str]
    ext_counts: list[dict[str, int]]

    @property
    def total(self) -> int:
        return int(self.starts[-1])

    def shard_of(self, ids: np.ndarray[Any, Any]) -> _Int64s:
        found: _Int64s = np.searchsorted(self.starts, ids, side="right") - 1
        return found

    def fingerprint(self) -> str:
        """``tars:`` and a hash of the shards' names (not where they are kept), sample counts and
        keys: the same dataset copied to an object store keeps its fingerprint."""
        digest = hashlib.sha256()
        for url, count, keys in zip(self.urls, self.counts.tolist(), self.keys_hashes, strict=True):
            digest.update(f"{posixpath.basename(url)}\0{count}\0{keys}\n".encode())
        return f"tars:{digest.hexdigest()[:16]}"


def open_shards(
    urls: str | Iterable[str],
    storage_options: dict[str, Any] | None,
    start_fraction: float,
    retries: int = RETRIES,
) -> TarShards:
    """Expand, check and index the shards (starting the walk at ``start_fraction`` of them)."""
    expanded = expand_urls(urls)
    kinds = {"://" in url and not url.startswith("file://") for url in expanded}
    if len(kinds) > 1:
        raise ValueError("the shards mix local paths and URLs; keep them in one place")
    protocols = {url.split("://", 1)[0] for url in expanded if "://" in url}
    if len(protocols) > 1:
        raise ValueError(f"the shards use several protocols ({sorted(protocols)}); use one")
    if len(set(expanded)) != len(expanded):
        raise ValueError("a shard is listed twice: every shard must appear once")
    storage = storage_for(expanded[0], storage_options, retries)
    count = len(expanded)
    counts = np.zeros(count, dtype=np.int64)
    hashes = [""] * count
    ext_counts: list[dict[str, int]] = [{}] * count

    def opened(k: int, index: TarIndex) -> None:
        counts[k] = index.samples
        hashes[k] = index.keys_hash
        ext_counts[k] = index.ext_counts

    open_indexes(expanded, storage, int(start_fraction * count) % count, opened)
    starts = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    return TarShards(expanded, storage, counts, starts, hashes, ext_counts)


class TarOrder:
    """The samples at positions of one epoch (see the module docstring): shards permuted and
    taken ``window`` at a time, samples permuted inside each group."""

    def __init__(self, shards: TarShards, epoch: int, seed: int, window: int) -> None:
        count = len(shards.counts)
        self.shards, self.window, self.epoch, self.seed = shards, window, epoch, seed
        self.permuted: _Int64s = EpochOrder(count, epoch, seed, True).at(np.arange(count))
        #: where each permuted shard's samples start in the epoch, and the total
        self.runs: _Int64s = np.concatenate(
            [np.zeros(1, np.int64), np.cumsum(shards.counts[self.permuted])]
        )
        #: where each group of ``window`` permuted shards starts, and the total
        self.group_starts: _Int64s = self.runs[np.r_[np.arange(0, count, window), count]]

    def at(self, positions: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        positions = np.asarray(positions, dtype=np.int64)
        groups = np.searchsorted(self.group_starts, positions, side="right") - 1
        ids = np.empty_like(positions)
        for group in np.unique(groups).tolist():
            chosen = groups == group
            first = int(self.group_starts[group])
            size = int(self.group_starts[group + 1]) - first
            key = np.random.SeedSequence([self.seed, self.epoch, group]).generate_state(1)
            within = EpochOrder(size, self.epoch, int(key[0]), True).at(positions[chosen] - first)
            # ``within`` counts the group's samples, its permuted shards one after another
            slots = group * self.window
            inner = self.runs[slots : slots + self.window + 1] - first
            slot = np.searchsorted(inner, within, side="right") - 1
            shard = self.permuted[slots + slot]
            ids[chosen] = self.shards.starts[shard] + (within - inner[slot])
        return ids


class TarOrders:
    """``orders(epoch)`` for :class:`BatchedSamples`: the :class:`TarOrder` of each epoch (the
    last two are kept: the worker asks for the current and the next one)."""

    def __init__(self, shards: TarShards, seed: int, window: int) -> None:
        self.shards, self.seed, self.window = shards, seed, window
        self._made: OrderedDict[int, TarOrder] = OrderedDict()

    def __call__(self, epoch: int) -> TarOrder:
        order = self._made.get(epoch)
        if order is None:
            order = self._made[epoch] = TarOrder(self.shards, epoch, self.seed, self.window)
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
    """Reads whole byte ranges of remote shards ahead of the samples that need them."""

    def __init__(self, storage: Storage, ahead: int) -> None:
        self.storage, self.ahead = storage, ahead
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._buffers: dict[int, tuple[int, Future[np.ndarray[Any, Any]]]] = {}
        self._needs: list[tuple[int, int, int, int, int]] = []  # shard, first, last, start, end
        self._next = 0
        self._step = -1

    def plan(self, needs: list[tuple[int, int, int, int, int]], url: Any) -> None:
        """A new epoch: ``needs`` (shard, first step, last step, start byte, end byte) in the
        order the shards are first needed."""
        with self._lock:
            self._stop()
            self._needs, self._next, self._step, self._url = needs, 0, -1, url
            self._pool = ThreadPoolExecutor(min(4, self.ahead + 1), "tar-fetch")
            self._schedule()

    def passed(self, step: int) -> None:
        with self._lock:
            self._step = step
            for shard, _first, last, _start, _end in self._needs[: self._next]:
                if last <= step:
                    self._buffers.pop(shard, None)
            self._schedule()

    def _schedule(self) -> None:
        assert self._pool is not None
        loading = self._step + 1
        while self._next < len(self._needs):
            shard, first, _last, start, end = self._needs[self._next]
            waiting = sum(
                1 for s, f, *_ in self._needs[: self._next] if f > loading and s in self._buffers
            )
            if first > loading and waiting >= self.ahead:
                return
            future = self._pool.submit(self.storage.read, self._url(shard), start, end)
            self._buffers[shard] = (start, future)
            self._next += 1

    def get(self, shard: int, start: int, end: int) -> np.ndarray[Any, Any] | None:
        """Bytes ``[start, end)`` of ``shard`` if they were fetched (waits for a fetch under
        way); None when they were not."""
        with self._lock:
            held = self._buffers.get(shard)
        if held is None:
            return None
        first, future = held
        data = future.result()
        if start < first or end > first + len(data):
            return None
        return data[start - first : end - first]

    def _stop(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._buffers.clear()

    def close(self) -> None:
        with self._lock:
            self._stop()


class TarLoader:
    """``load(index)`` of :func:`sharded_tars`: the sample's members, one output per extension."""

    def __init__(
        self, shards: TarShards, ext: Sequence[Sequence[str]], ahead: int, names: Sequence[str]
    ) -> None:
        self.shards, self.ext, self.names = shards, [list(e) for e in ext], list(names)
        self._indexer = Indexer(shards.storage)
        self._tables: OrderedDict[int, tuple[TarIndex, _Int64s, _Int64s]] = OrderedDict()
        self._lock = threading.Lock()
        self._fetcher = None if shards.storage.local else _Fetcher(shards.storage, ahead)
        self._starts: list[int] = shards.starts.tolist()
        self._integers = [INTEGER_EXTS.get(name) for name in self.names]

    def _table(self, shard: int) -> tuple[TarIndex, _Int64s, _Int64s]:
        with self._lock:
            found = self._tables.get(shard)
            if found is not None:
                self._tables.move_to_end(shard)
                return found
        url = self.shards.urls[shard]
        identity = self.shards.storage.identities([local_path(url)])[0]
        index = self._indexer.find(url, identity) or self._indexer.make(url, identity, wait=True)
        if index is None or index.samples != self.shards.counts[shard]:
            raise StorageFailure(
                f"{url} changed while the loader runs (its index no longer matches): "
                "restart the job, whose state refuses the changed dataset"
            )
        offsets, sizes = index.table(self.ext)
        with self._lock:
            self._tables[shard] = (index, offsets, sizes)
            while len(self._tables) > _OPEN_INDEXES:
                self._tables.popitem(last=False)
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
        try:
            table, offsets, sizes = self._table(shard)
        except StorageFailure:
            raise
        except (OSError, EOFError) as error:
            raise StorageFailure(f"cannot read {url}: {error}") from error
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
        data = self._read(shard, url, start, end)
        outputs = []
        for column, (offset, size) in enumerate(zip(row_offsets, row_sizes, strict=True)):
            member = data[offset - start : offset - start + size]
            dtype = self._integers[column]
            if dtype is None:
                outputs.append(member)
            else:
                outputs.append(_decode_int(member, dtype, table, sample, self.names[column]))
        return tuple(outputs)

    def _read(self, shard: int, url: str, start: int, end: int) -> np.ndarray[Any, Any]:
        try:
            if self._fetcher is not None:
                fetched = self._fetcher.get(shard, start, end)
                if fetched is not None:
                    return fetched
            return self.shards.storage.read(local_path(url), start, end)
        except (OSError, EOFError) as error:
            raise StorageFailure(f"cannot read {url}: {error}") from error

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
            _table, offsets, sizes = self._table(shard)
            rows = flat[chosen] - int(self.shards.starts[shard])
            ends = np.where(sizes[rows] < 0, 0, offsets[rows] + sizes[rows])
            begins = np.where(offsets[rows] < 0, np.iinfo(np.int64).max, offsets[rows])
            needs.append(
                (
                    shard,
                    int(steps[chosen].min()),
                    int(steps[chosen].max()),
                    int(begins.min()),
                    int(ends.max()),
                )
            )
        self._fetcher.plan(needs, lambda k: local_path(self.shards.urls[k]))

    def passed(self, epoch: int, step: int) -> None:
        if self._fetcher is not None:
            self._fetcher.passed(step)

    def __del__(self) -> None:
        fetcher = getattr(self, "_fetcher", None)
        if fetcher is not None:
            fetcher.close()


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


def sharded_tars(
    shard: Shard,
    urls: str | Sequence[str],
    *,
    batch_size: int,
    ext: str | Sequence[str] = ("jpg", "cls"),
    shuffle: bool = True,
    drop_last: bool = False,
    storage_options: dict[str, Any] | None = None,
    shuffle_window: int | None = None,
    ahead: int = 2,
    retries: int = RETRIES,
) -> Any:
    """An ``ndd.ExternalSource`` root over WebDataset tar shards: one output per ``ext``.

    ``urls``: a list of paths or fsspec URLs, or one string with brace patterns
    (``"s3://bucket/train-{000000..000127}.tar"``); ``storage_options`` go to the filesystem
    (``s3fs``: ``key``, ``secret``, ``endpoint_url``...). ``ext``: the members each sample gives,
    in output order (``"jpg;png"``: either); ``cls``-like members are parsed as integers.
    ``shuffle_window``: how many shards' samples an epoch shuffles together (None: all for local
    shards, :data:`REMOTE_WINDOW` for remote ones; see the module docstring); ``ahead``: remote
    shards fetched ahead of the one being read; ``retries``: how many times a remote read that
    failed for a transient reason (a connection reset, a timeout, throttling) is tried again,
    with backoff, each logged (a missing object or denied access is raised at once). The same
    guarantees as :func:`sharded_source`.
    """
    from ._dali import ShardedExternalSource

    opened = open_tar_source(
        shard,
        urls,
        ext=ext,
        storage_options=storage_options,
        shuffle_window=shuffle_window,
        ahead=ahead,
        retries=retries,
        seed=shard.seed - shard.index,
        shuffle=shuffle,
    )
    samples = BatchedSamples(
        shard,
        opened.total,
        opened.load,
        batch_size,
        num_outputs=opened.num_outputs,
        shuffle=shuffle,
        drop_last=drop_last,
        fingerprint=opened.fingerprint,
        orders=opened.orders,
    )
    return ShardedExternalSource(samples)


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
) -> OpenedSource:
    """Check the arguments, open (index) the shards and make the loader and epoch orders."""
    wanted = parse_ext(ext)
    for name, value, low in (("retries", retries, 0), ("ahead", ahead, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if shuffle_window is not None and (
        isinstance(shuffle_window, bool)
        or not isinstance(shuffle_window, int)
        or shuffle_window < 1
    ):
        raise ValueError(f"shuffle_window must be None or an integer >= 1, got {shuffle_window!r}")
    shards = open_shards(urls, storage_options, shard.index / max(1, shard.count), retries)
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
    load = TarLoader(shards, wanted, ahead, names)
    return OpenedSource(
        shards.total, load, len(wanted), fingerprint, tuple(names), orders, load.describe
    )


def write_tars(
    root: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    samples_per_shard: int,
    shuffle: bool = True,
    seed: int = 0,
    prefix: str = "train",
) -> list[Path]:
    """Write ImageFolder ``root`` as WebDataset shards ``<out>/<prefix>-000000.tar``...: each
    sample ``<key>.<image ext>`` (the file's bytes) and ``<key>.cls`` (its label), keys numbered
    in the written order. ``shuffle``: samples in a seeded random order (so each shard holds a
    mix of classes, which shuffling by groups of shards needs), else in the folder's order.
    The same folder and seed always give the same bytes."""
    if isinstance(samples_per_shard, bool) or not isinstance(samples_per_shard, int):
        raise ValueError(f"samples_per_shard must be an integer, got {samples_per_shard!r}")
    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard must be >= 1, got {samples_per_shard}")
    files, labels = list_files(root)
    order = np.arange(len(files))
    if shuffle:
        order = np.random.default_rng(seed).permutation(len(files))
    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for number, first in enumerate(range(0, len(files), samples_per_shard)):
        path = target / f"{prefix}-{number:06d}.tar"
        temporary = path.with_name(path.name + ".tmp")
        with tarfile.open(temporary, "w", format=tarfile.USTAR_FORMAT) as tar:
            for key_number in order[first : first + samples_per_shard].tolist():
                source = files[key_number]
                ext = os.path.splitext(source)[1].lower().lstrip(".")
                ext = "jpg" if ext == "jpeg" else ext
                key = f"{key_number:09d}"
                _add(tar, f"{key}.{ext}", read_file(source).tobytes())
                _add(tar, f"{key}.cls", str(labels[key_number]).encode())
        os.replace(temporary, path)
        written.append(path)
    return written


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    import io

    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o444, 0
    tar.addfile(info, io.BytesIO(data))
