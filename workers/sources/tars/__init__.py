"""The WebDataset tar format: shards read sample by sample by byte range, each shard's index
(keys, member offsets and sizes), a directory's summary of them all, and the offline tools that
write shards and index a dataset. Runs in the worker (the reader) and in ``python -m
loader.tars`` (the tools).

The reader, bottom up: ``_index`` (a shard's index, scanned or mapped from this node's cache),
``_wds_idx`` (DALI's ``.idx`` beside a shard), ``_summary`` (a directory's summary),
``_indexer`` (finds or makes a shard's index at run time: cache, ``.idx``, scan), ``_shards``
(a job's set of shards, opened: :class:`TarShards`, :func:`open_shards`; with ``_listing``,
what one listing per directory or a summary tells of them, and ``_walk``, the indexes found
or made shard after shard), ``_order`` (an epoch's order, shuffled within groups of shards),
``_fetch`` (the byte ranges fetched ahead), ``_names`` (the shards a job's URLs name:
directories, globs), ``_members`` (what a sample's outputs are made of) and ``_reader`` (the
loader and :func:`open_tar_source`). The writer (``_writer``: :func:`write_tars`) and the
index command (``_tool``: :func:`index_dataset`) are offline tools: no module of the reader
imports them.

May import: the standard library, numpy, :mod:`workers.spec`, and the wings below it:
:mod:`workers.sources.plan`, :mod:`workers.sources.storage`, :mod:`workers.sources.files`
(through their faces).
"""

from ._listing import node_listing, node_read
from ._members import INTEGER_EXTS, parse_ext
from ._order import TarOrder, TarOrders
from ._reader import REMOTE_WINDOW, TarLoader, open_tar_source
from ._shards import TarShards, open_shards
from ._tool import Progress, index_dataset
from ._writer import write_tars

__all__ = [
    "INTEGER_EXTS",
    "REMOTE_WINDOW",
    "Progress",
    "TarLoader",
    "TarOrder",
    "TarOrders",
    "TarShards",
    "index_dataset",
    "node_listing",
    "node_read",
    "open_shards",
    "open_tar_source",
    "parse_ext",
    "write_tars",
]
