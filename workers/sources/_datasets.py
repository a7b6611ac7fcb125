"""The dataset definitions, one type each: what the Loader takes as its ``source``, what a
mixture takes, and what each ``sharded_*`` function wraps. Runs in the worker (and, as frozen
picklable values, in the trainer, which sends them to the worker).

A definition holds what the dataset is (paths, URLs, a ``load``) and how an epoch takes it
(``shuffle``, ``drop_last``), never a batch size: that is the Loader's. In the worker,
:meth:`Definition.batched` opens ``shard``'s part of it (:meth:`_Opened.open`: its size, how to
load a sample, its fingerprint, its own epoch orders) into a :class:`BatchedSamples` of the
loader's batch size, with every guarantee of :func:`~workers.sources._sharded.sharded_source`;
the worker binds its control state and puts the batches under DALI itself. ``sharded_files(shard,
root, batch_size=..., ...)`` is ``FilesDataset(root).source(shard, batch_size=..., ...)``,
``sharded_tars`` is ``TarsDataset``'s, ``sharded_parquet`` ``ParquetDataset``'s and
``sharded_source`` ``SamplesDataset``'s;
:class:`~workers.sources._mix.MixDataset` (and ``sharded_mix``) opens each of the datasets it
mixes.
"""

from __future__ import annotations

import numbers
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, fields
from typing import Any

from ..spec import Shard
from .files import MAX_IMAGE_PIXELS, checked_limit
from .plan import BatchedSamples, Batching, OpenedSource
from .storage import AHEAD_BYTES, RETRIES, url_protocols


class Definition(ABC):
    """What every dataset definition does: frozen and picklable (the trainer sends it to each
    worker), opened in the worker for one shard. ``shuffle`` and ``drop_last`` are fields of
    each definition (:class:`Batching`'s options but the batch size, with their defaults)."""

    shuffle: bool
    drop_last: bool

    def batched(self, shard: Shard, batch_size: int) -> BatchedSamples:
        """``shard``'s part of this dataset in full batches of ``batch_size`` (the loader's,
        when the worker opens the definition the Loader was given): exactly once per epoch,
        padding flagged, a resumable position."""
        return self._batched(shard, Batching(batch_size, self.shuffle, self.drop_last))

    def source(
        self,
        shard: Shard,
        *,
        batch_size: int,
        shuffle: bool | None = None,
        drop_last: bool | None = None,
    ) -> BatchedSamples:
        """What ``source(shard)`` returns for this dataset in a hand-written source, as the
        ``sharded_*`` functions do: :meth:`batched`, with ``shuffle``/``drop_last`` given here
        in place of the definition's (None: the definition's). ``batch_size`` must be the
        Loader's (checked in the worker); passing the definition itself to the Loader gives it
        once."""
        batching = Batching(
            batch_size,
            self.shuffle if shuffle is None else shuffle,
            self.drop_last if drop_last is None else drop_last,
        )
        return self._batched(shard, batching)

    @abstractmethod
    def _batched(self, shard: Shard, batching: Batching) -> BatchedSamples:
        """:meth:`batched`, its options as one."""

    def server_needs(self) -> tuple[str, ...]:
        """What the workers will open, for the worker server to import before it forks them:
        ``protocol:<name>`` for each remote store of the definition's URLs, and
        ``module:<name>`` for a format's library (:mod:`workers.startup`)."""
        return ()


def protocols_of(urls: Any) -> tuple[str, ...]:
    """``protocol:<name>`` for each remote protocol among ``urls`` (a URL, a path or a sequence
    of them), in order, once."""
    given = [urls] if isinstance(urls, (str, os.PathLike)) else urls
    if not isinstance(given, Sequence):
        return ()
    texts = [os.fspath(u) for u in given if isinstance(u, (str, os.PathLike))]
    found = dict.fromkeys(protocol.lower() for protocol in url_protocols(texts))
    return tuple(f"protocol:{protocol}" for protocol in found)


class _Opened(Definition):
    """A dataset that opens into one :class:`OpenedSource` (every kind but a mixture)."""

    @abstractmethod
    def open(self, shard: Shard, seed: int, *, shuffle: bool = True) -> OpenedSource:
        """The dataset opened in a worker: its size, ``load``, fingerprint and orders."""

    def _reader_arguments(self) -> dict[str, Any]:
        """The definition's fields as its reader's ``open_*_source`` takes them, by name (the
        reader's keywords are the fields' names): all but the batching options, the storage
        options as a plain dict."""
        batching = {option.name for option in fields(Batching)}
        arguments = {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]
        arguments = {k: v for k, v in arguments.items() if k not in batching}
        if "storage_options" in arguments:
            arguments["storage_options"] = dict(arguments["storage_options"] or {})
        return arguments

    def _batched(self, shard: Shard, batching: Batching) -> BatchedSamples:
        opened = self.open(shard, shard.seed - shard.index, shuffle=batching.shuffle)
        return BatchedSamples(
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


def _check_labels(files: Any, labels: Sequence[int] | None) -> None:
    """``labels`` (when given): one int (int32) per file of a list; ``TypeError`` or
    ``ValueError`` naming the first that is not (a float was cut to an int, silently, and a
    label that is no number failed in every worker, not naming ``labels=``)."""
    if labels is None:
        return
    if isinstance(labels, (str, bytes)) or not isinstance(labels, Sequence):
        raise TypeError(f"labels= must be a sequence of ints, one per file, got {labels!r}")
    for position, label in enumerate(labels):
        if isinstance(label, bool) or not isinstance(label, numbers.Integral):
            raise TypeError(
                f"labels[{position}] is {label!r} ({type(label).__name__}): labels= takes one "
                "int per file (the class's number)"
            )
        if not -(2**31) <= int(label) < 2**31:
            raise ValueError(f"labels[{position}] is {label}, past int32 (labels are int32)")
    listed = not isinstance(files, (str, os.PathLike))
    if listed and isinstance(files, Sequence) and len(files) != len(labels):
        raise ValueError(f"{len(files)} files but {len(labels)} labels: give one per file")


@dataclass(frozen=True)
class FilesDataset(_Opened):
    """An ImageFolder or a list of files (with ``labels``), as :func:`sharded_files` reads it:
    outputs ``(encoded bytes, label)``. ``Loader(FilesDataset(root), step, batch_size=64)``."""

    root_or_files: str | os.PathLike[str] | Sequence[str]
    labels: Sequence[int] | None = None
    max_image_pixels: int | None = MAX_IMAGE_PIXELS
    _: KW_ONLY
    shuffle: bool = True
    drop_last: bool = False

    def __post_init__(self) -> None:
        _check_labels(self.root_or_files, self.labels)

    def server_needs(self) -> tuple[str, ...]:
        return protocols_of(self.root_or_files)

    def open(self, shard: Shard, seed: int, *, shuffle: bool = True) -> OpenedSource:
        from .files import FileLoader, open_files

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
class TarsDataset(_Opened):
    """WebDataset tar shards, as :func:`sharded_tars` reads them (the same arguments).
    ``Loader(TarsDataset(urls), step, batch_size=64)``."""

    urls: str | os.PathLike[str] | Sequence[str]
    ext: str | Sequence[str] = ("jpg", "cls")
    storage_options: Mapping[str, Any] | None = None
    shuffle_window: int | None = None
    ahead: int = 2
    retries: int = RETRIES
    ahead_bytes: int | None = AHEAD_BYTES
    max_image_pixels: int | None = MAX_IMAGE_PIXELS
    optional: Mapping[str, Any] | None = None
    _: KW_ONLY
    shuffle: bool = True
    drop_last: bool = False
    #: write the indexes and the summary the workers make beside the shards (as ``python -m
    #: loader.tars index`` does), not only in this node's cache: reading never writes where
    #: the data lives unless asked
    publish_index: bool = False

    def server_needs(self) -> tuple[str, ...]:
        return protocols_of(self.urls)

    def open(self, shard: Shard, seed: int, *, shuffle: bool = True) -> OpenedSource:
        from .tars import open_tar_source

        return open_tar_source(shard, seed=seed, shuffle=shuffle, **self._reader_arguments())


@dataclass(frozen=True)
class SamplesDataset(_Opened):
    """``total`` samples made by ``load(index)`` (``load(index, epoch)`` with ``pass_epoch``),
    as :func:`sharded_source` takes them. ``names``: the outputs' names, checked against the
    other sources' of a mixture when given."""

    total: int
    load: Callable[..., Any]
    num_outputs: int = 1
    fingerprint: str | None = None
    names: tuple[str, ...] | None = None
    pass_epoch: bool = False
    _: KW_ONLY
    shuffle: bool = True
    drop_last: bool = False

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
class ParquetDataset(_Opened):
    """Parquet files (those of the Hugging Face Hub and of ``datasets``), as
    :func:`sharded_parquet` reads them (the same arguments): one output per column. ``urls`` may
    be a ``datasets.Dataset`` (from ``load_dataset`` or ``load_from_disk``): its Arrow files are
    read where they lie; the definition holds their paths and the dataset's fingerprint."""

    urls: Any
    columns: str | Sequence[str] = ("image", "label")
    storage_options: Mapping[str, Any] | None = None
    shuffle_window: int | None = None
    ahead: int = 2
    retries: int = RETRIES
    ahead_bytes: int | None = AHEAD_BYTES
    max_image_pixels: int | None = MAX_IMAGE_PIXELS
    optional: Mapping[str, Any] | None = None
    page_index: bool = True
    _: KW_ONLY
    shuffle: bool = True
    drop_last: bool = False

    def __post_init__(self) -> None:
        if (type(self.urls).__module__ or "").split(".", 1)[0] == "datasets":
            from .parquet import arrow_files_of  # (its files, not the object, go to the workers)

            columns = (self.columns,) if isinstance(self.columns, str) else tuple(self.columns)
            object.__setattr__(self, "urls", arrow_files_of(self.urls, columns))

    def server_needs(self) -> tuple[str, ...]:
        # (pyarrow.compute: a struct column read by its pages is put together with it; 70 ms
        # of import a worker would otherwise pay before its first batch)
        return (*protocols_of(self.urls), "module:pyarrow.parquet", "module:pyarrow.compute")

    def open(self, shard: Shard, seed: int, *, shuffle: bool = True) -> OpenedSource:
        from .parquet import open_parquet_source

        return open_parquet_source(shard, seed=seed, shuffle=shuffle, **self._reader_arguments())


Dataset = FilesDataset | TarsDataset | ParquetDataset | SamplesDataset
