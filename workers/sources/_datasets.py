"""The dataset kinds, one type each: what a mixture takes and what each ``sharded_*`` function
wraps. Runs in the worker.

A dataset is a definition (paths, URLs, a ``load``): :meth:`open` opens it in a worker (its
size, how to load a sample, its fingerprint, its own epoch orders), and :meth:`source` makes the
``ndd.ExternalSource`` root of one shard of it, with every guarantee of
:func:`~workers.sources._sampling.sharded_source`. ``sharded_files(shard, root, ...)`` is
``FilesDataset(root).source(shard, ...)``, ``sharded_tars`` is ``TarsDataset``'s,
``sharded_parquet`` ``ParquetDataset``'s and ``sharded_source`` is ``SamplesDataset``'s;
:func:`~workers.sources._mix.sharded_mix` opens each of the datasets it mixes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..spec import Shard
from ._image_size import MAX_IMAGE_PIXELS, checked_limit
from ._sampling import BatchedSamples, Batching, OpenedSource
from ._storage import AHEAD_BYTES, RETRIES


class _Kind:
    """What every dataset kind does with what it opens."""

    def open(self, shard: Shard, seed: int, *, shuffle: bool = True) -> OpenedSource:
        raise NotImplementedError

    def source(
        self, shard: Shard, *, batch_size: int, shuffle: bool = True, drop_last: bool = False
    ) -> Any:
        """The ``ndd.ExternalSource`` root of ``shard``'s part of this dataset: exactly once
        per epoch, full batches, padding flagged, a resumable position."""
        return self._batched(shard, Batching.pick(locals()))

    def _batched(self, shard: Shard, batching: Batching) -> Any:
        """:meth:`source`, its options (those of every ``sharded_*`` function) as one."""
        from ..dali import ShardedExternalSource

        opened = self.open(shard, shard.seed - shard.index, shuffle=batching.shuffle)
        samples = BatchedSamples(
            shard,
            opened.total,
            opened.load,
            batching,
            num_outputs=opened.num_outputs,
            fingerprint=opened.fingerprint,
            parts=opened.parts,
            left_out=opened.left_out,
            pass_epoch=opened.pass_epoch,
            orders=opened.orders,
        )
        return ShardedExternalSource(samples)


@dataclass(frozen=True)
class FilesDataset(_Kind):
    """An ImageFolder or a list of files (with ``labels``), as :func:`sharded_files` reads it:
    outputs ``(encoded bytes, label)``."""

    root_or_files: str | os.PathLike[str] | Sequence[str]
    labels: Sequence[int] | None = None
    max_image_pixels: int | None = MAX_IMAGE_PIXELS

    def open(self, shard: Shard, seed: int, *, shuffle: bool = True) -> OpenedSource:
        from ._files import FileLoader, open_files

        limit = checked_limit(self.max_image_pixels)
        files = open_files(self.root_or_files, self.labels)
        load = FileLoader(files, limit)
        return OpenedSource(
            len(files),
            load,
            2,
            files.fingerprint,
            ("jpg", "cls"),
            describe=load.describe,
            parts=files.parts,
        )


@dataclass(frozen=True)
class TarsDataset(_Kind):
    """WebDataset tar shards, as :func:`sharded_tars` reads them (the same arguments)."""

    urls: str | Sequence[str]
    ext: str | Sequence[str] = ("jpg", "cls")
    storage_options: Mapping[str, Any] | None = None
    shuffle_window: int | None = None
    ahead: int = 2
    retries: int = RETRIES
    ahead_bytes: int | None = AHEAD_BYTES
    max_image_pixels: int | None = MAX_IMAGE_PIXELS

    def open(self, shard: Shard, seed: int, *, shuffle: bool = True) -> OpenedSource:
        from ._tars import open_tar_source

        return open_tar_source(
            shard,
            self.urls,
            ext=self.ext,
            storage_options=dict(self.storage_options or {}),
            shuffle_window=self.shuffle_window,
            ahead=self.ahead,
            ahead_bytes=self.ahead_bytes,
            retries=self.retries,
            seed=seed,
            shuffle=shuffle,
            max_image_pixels=self.max_image_pixels,
        )


@dataclass(frozen=True)
class SamplesDataset(_Kind):
    """``total`` samples made by ``load(index)`` (``load(index, epoch)`` with ``pass_epoch``),
    as :func:`sharded_source` takes them. ``names``: the outputs' names, checked against the
    other sources' of a mixture when given."""

    total: int
    load: Callable[..., Any]
    num_outputs: int = 1
    fingerprint: str | None = None
    names: tuple[str, ...] | None = None
    pass_epoch: bool = False

    def open(self, shard: Shard, seed: int, *, shuffle: bool = True) -> OpenedSource:
        if isinstance(self.total, bool) or not isinstance(self.total, int) or self.total < 1:
            raise ValueError(f"total must be a positive number of samples, got {self.total!r}")
        if self.fingerprint is not None and not isinstance(self.fingerprint, str):
            raise TypeError(f"fingerprint must be a str, got {type(self.fingerprint).__name__}")
        return OpenedSource(
            self.total,
            self.load,
            self.num_outputs,
            self.fingerprint or "",
            self.names,
            describe=getattr(self.load, "describe", None),
            pass_epoch=self.pass_epoch,
        )


@dataclass(frozen=True)
class ParquetDataset(_Kind):
    """Parquet files (those of the Hugging Face Hub and of ``datasets``), as
    :func:`sharded_parquet` reads them (the same arguments): one output per column."""

    urls: str | os.PathLike[str] | Sequence[str]
    columns: str | Sequence[str] = ("image", "label")
    storage_options: Mapping[str, Any] | None = None
    shuffle_window: int | None = None
    ahead: int = 2
    retries: int = RETRIES
    ahead_bytes: int | None = AHEAD_BYTES
    max_image_pixels: int | None = MAX_IMAGE_PIXELS

    def open(self, shard: Shard, seed: int, *, shuffle: bool = True) -> OpenedSource:
        from .parquet import open_parquet_source

        return open_parquet_source(
            shard,
            self.urls,
            columns=self.columns,
            storage_options=dict(self.storage_options or {}),
            shuffle_window=self.shuffle_window,
            ahead=self.ahead,
            ahead_bytes=self.ahead_bytes,
            retries=self.retries,
            seed=seed,
            shuffle=shuffle,
            max_image_pixels=self.max_image_pixels,
        )


Dataset = FilesDataset | TarsDataset | ParquetDataset | SamplesDataset
