"""The public ``sharded_*`` functions, thin wrappers for hand-written sources: one call that
builds a dataset definition (:mod:`._datasets`) and opens it for one shard, with a batch size
that must be the Loader's. ``source(shard)`` returns what they return (DALI-free batches); the
worker puts those under DALI as it does a definition given to the Loader. Runs in the worker.

Above the source modules (:mod:`.plan`, :mod:`.files`, :mod:`.tars`, :mod:`.parquet`) and the
dataset definitions, which never import it: the family has no import circle.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..spec import Shard
from ._datasets import FilesDataset, ParquetDataset, SamplesDataset, TarsDataset
from .files import MAX_IMAGE_PIXELS
from .plan import Batching
from .storage import AHEAD_BYTES, RETRIES


def sharded_files(
    shard: Shard,
    root_or_files: str | os.PathLike[str] | Sequence[str],
    *,
    batch_size: int,
    shuffle: bool = True,
    drop_last: bool = False,
    labels: Sequence[int] | None = None,
    max_image_pixels: int | None = MAX_IMAGE_PIXELS,
) -> Any:
    """Batches of ``(encoded bytes, label)`` of files, for ``source(shard)`` to return: a thin
    wrapper of :class:`FilesDataset` for a hand-written source (``batch_size``: the Loader's;
    ``Loader(FilesDataset(root_or_files), step, batch_size=...)`` gives it once).

    ``root_or_files``: an ImageFolder directory (sorted class folders give the labels) or an
    explicit list of files (``labels`` then gives one int per file; 0 when omitted). The same
    guarantees as :func:`sharded_source`: exactly once per epoch, full batches, padding flagged,
    a resumable position. Decode with ``ndd.decoders.image(jpegs)`` in ``step``. A directory is
    listed once and indexed in the loader's cache directory (``DALI_LOADER_CACHE_DIR``); later
    builds, in any worker, read the index. The list's fingerprint (a hash of the relative paths
    and sizes of a directory's files, read once with its listing; of the paths and labels of a
    list, whose files are not opened before they are read) goes into the loader's state: a
    state saved over other files is refused, naming the class folders that differ.

    ``max_image_pixels``: a file whose image header says it decodes to more pixels than this
    (Pillow's decompression-bomb threshold by default, about 89 M) is not handed to DALI: its
    load raises ``ImageTooLargeError``, which ``on_error="skip"`` skips like any failing
    sample. None: no limit.
    """
    batching = Batching.pick(locals())
    dataset = FilesDataset(root_or_files, labels, max_image_pixels=max_image_pixels)
    return dataset._batched(shard, batching)


def sharded_source(
    shard: Shard,
    total: int,
    load: Callable[..., Any],
    batch_size: int,
    *,
    num_outputs: int = 1,
    shuffle: bool = True,
    drop_last: bool = False,
    fingerprint: str | None = None,
    pass_epoch: bool = False,
) -> Any:
    """Batches of this shard's part of ``total`` samples, for ``source(shard)`` to return: a
    thin wrapper of :class:`SamplesDataset` for a hand-written source (``batch_size``: the
    Loader's; ``Loader(SamplesDataset(total, load), step, batch_size=...)`` gives it once).

    Every epoch covers the dataset exactly once across all shards (``drop_last=True`` drops the
    remainder instead of padding), batches are always full, and padded rows are reported in the
    delivered batch's ``info.padded``. The loader can save and resume its position.

    ``fingerprint``: a string that names what ``load`` reads (a dataset version, a manifest's
    hash); a state saved over one fingerprint is refused by a loader over another. With
    ``pass_epoch=True``, ``load`` is called as ``load(index, epoch)``: random draws made from
    ``(seed, epoch, index)`` there are the same on any layout.
    """
    batching = Batching.pick(locals())
    dataset = SamplesDataset(
        total, load, num_outputs, fingerprint=fingerprint, pass_epoch=pass_epoch
    )
    return dataset._batched(shard, batching)


def sharded_tars(
    shard: Shard,
    urls: str | os.PathLike[str] | Sequence[str],
    *,
    batch_size: int,
    ext: str | Sequence[str] = ("jpg", "cls"),
    shuffle: bool = True,
    drop_last: bool = False,
    storage_options: dict[str, Any] | None = None,
    shuffle_window: int | None = None,
    ahead: int = 2,
    retries: int = RETRIES,
    ahead_bytes: int | None = AHEAD_BYTES,
    max_image_pixels: int | None = MAX_IMAGE_PIXELS,
    optional: Mapping[str, Any] | None = None,
    publish_index: bool = False,
) -> Any:
    """Batches of WebDataset tar shards, one output per ``ext``, for ``source(shard)`` to
    return: a thin wrapper of :class:`TarsDataset` for a hand-written source (``batch_size``:
    the Loader's; ``Loader(TarsDataset(urls), step, batch_size=...)`` gives it once).

    ``urls``: a shard, a directory (its ``*.tar`` files in name order), a glob
    (``"data/*.tar"``; only ``*.tar`` matches are shards), one string with brace patterns
    (``"s3://bucket/train-{000000..000127}.tar"``), or a list of these; local paths or fsspec
    URLs. Files beside the shards (img2dataset's ``.parquet`` and ``_stats.json``, the loader's
    ``.idx`` and summary) are never taken for shards. ``storage_options`` go to the filesystem
    (``s3fs``: ``key``, ``secret``, ``endpoint_url``...). ``ext``: the members each sample gives,
    in output order (``"jpg;png"``: either); ``cls``-like members are parsed as integers;
    ``"__key__"`` and ``"__url__"`` (WebDataset's names) give the sample's key and its shard's
    URL as UTF-8 bytes (``loader.texts`` makes them ``str``). ``optional``: members some
    samples lack, and the default each such sample gets (``{"txt": b""}``): counted per member
    in ``stats().defaulted``, not skipped; a sample without a member that is not optional is
    skipped (``on_error="skip"``), named ``<tar>:<key>``.
    ``shuffle_window``: how many shards' samples an epoch shuffles together (None: all for local
    shards, :data:`REMOTE_WINDOW` for remote ones; see the module docstring); ``ahead``: remote
    shards fetched ahead of the one being read, at most; ``ahead_bytes``: and at most that many
    bytes of them past the first (None: no limit; a shard's bytes are known from its size);
    ``retries``: how many times a remote read that
    failed for a transient reason (a connection reset, a timeout, throttling) is tried again,
    with backoff, each logged (a missing object or denied access is raised at once);
    ``max_image_pixels``: as for :func:`sharded_files`, of every member that is an image;
    ``publish_index``: the indexes and summary the workers make of unindexed shards are written
    beside the shards (as ``python -m loader.tars index`` does) instead of only into this
    node's cache. The same guarantees as :func:`sharded_source`.
    """
    batching = Batching.pick(locals())
    dataset = TarsDataset(
        urls,
        ext,
        storage_options,
        shuffle_window,
        ahead,
        retries,
        ahead_bytes,
        max_image_pixels=max_image_pixels,
        optional=optional,
        publish_index=publish_index,
    )
    return dataset._batched(shard, batching)


def sharded_parquet(
    shard: Shard,
    urls: str | os.PathLike[str] | Sequence[str],
    *,
    batch_size: int,
    columns: str | Sequence[str] = ("image", "label"),
    shuffle: bool = True,
    drop_last: bool = False,
    storage_options: dict[str, Any] | None = None,
    shuffle_window: int | None = None,
    ahead: int = 2,
    retries: int = RETRIES,
    ahead_bytes: int | None = AHEAD_BYTES,
    max_image_pixels: int | None = MAX_IMAGE_PIXELS,
    optional: Mapping[str, Any] | None = None,
    page_index: bool = True,
) -> Any:
    """An ``ndd.ExternalSource`` root over Parquet files: one output per column of ``columns``.

    ``urls``: a file, a directory (its ``*.parquet`` files in name order), a glob, an fsspec URL
    (``s3://bucket/train/``: ``storage_options`` go to the filesystem) or a list of them; the
    Parquet files of the Hugging Face Hub and those ``datasets`` writes (``to_parquet``) are
    read as they are. A column gives: an ``Image`` (Hugging Face's ``struct<bytes, path>``) its
    encoded bytes (those of the file at ``path`` where ``bytes`` is empty; decode them with
    ``ndd.decoders.image``), binary its bytes, an integer or ``ClassLabel`` an int64, a float a
    float32, a string its UTF-8 bytes, a list of numbers an array; any other type is refused at
    the start, naming the column. The plan comes from the files' footers (one ranged read each);
    the row group is the unit an epoch deals to the shards, and each is read with one ranged
    read of the requested columns' bytes, ``ahead`` of its need within ``ahead_bytes``.
    ``shuffle_window``: how many row groups' rows an epoch shuffles together (None: as many as
    take 64 MiB of the requested columns, at least one). The same guarantees as
    :func:`sharded_source`: exactly once per epoch, full batches, padding flagged, a position
    resumed exactly on any layout. ``optional``: columns some rows leave null, and the default
    such a row gets (``{"caption": b""}``: bytes or a ``str`` for image, binary and string
    columns, a number for numeric ones, a sequence for lists), counted per column in
    ``stats().defaulted``, not skipped; a null in a column that is not optional fails the sample
    (a skip, named, under ``on_error="skip"``). ``page_index``: where a worker needs only some
    rows of a large row group (its part of one the layout cuts, or the rows a resume still owes)
    and the file has a page index (``datasets`` >= 4.6 writes one), read only the pages that
    hold them (False: the whole row group). Needs pyarrow (``pip install
    'dali-capture-loader[parquet]'``).
    """
    batching = Batching.pick(locals())
    dataset = ParquetDataset(
        urls,
        columns,
        storage_options,
        shuffle_window,
        ahead,
        retries,
        ahead_bytes,
        max_image_pixels,
        optional,
        page_index,
    )
    return dataset._batched(shard, batching)
