"""The bytes every format reads: local files (``pread``) or fsspec URLs, each object's identity
(size, version), retries of transient failures, the URL patterns a job names, and the index
files that readers map. Runs in the worker (and in ``python -m loader.tars``).

* ``_storage``: :class:`Storage` (local or remote), :func:`storage_for`, retries, the URL
  patterns a job names;
* ``_failures``: identities, :class:`StorageFailure`, and which errors are transient;
* ``_many``: many small ranged reads at once (:func:`read_each`: on the filesystem's event loop
  where it has one);
* ``_cache``: the node's cache directory, where the indexes a worker makes are kept;
* ``_summaries``: what every format's summary shares (its document checked, this node's
  copy, its writing beside the data or into that copy);
* ``_index_file``: index files (a JSON header and numpy arrays in one mapped file) and the lock
  that makes one process build one while the others wait.

May import: the standard library, numpy (fsspec inside functions), :mod:`workers.startup` (the
storage backends a script opens) and :mod:`workers.sources.plan` (the pool's token). Nothing of
the formats (:mod:`workers.sources.files`, :mod:`workers.sources.tars`): they import this.
"""

from ._cache import CACHE_DIR_ENV, cache_dir
from ._failures import Identity, IdentityChanged, StorageFailure, storage_failure
from ._index_file import locked
from ._index_file import read as read_index_file
from ._index_file import write as write_index_file
from ._libraries import StorageLibraryError, check_storage_libraries, url_protocols
from ._many import read_each
from ._patterns import expand_urls, is_glob, local_glob
from ._reads import count_read, reads_so_far
from ._storage import (
    AHEAD_BYTES,
    RETRIES,
    Storage,
    is_url,
    local_path,
    storage_for,
)
from ._summaries import cached_path, open_document, write_document

__all__ = [
    "AHEAD_BYTES",
    "CACHE_DIR_ENV",
    "RETRIES",
    "Identity",
    "IdentityChanged",
    "Storage",
    "StorageFailure",
    "StorageLibraryError",
    "cache_dir",
    "cached_path",
    "check_storage_libraries",
    "count_read",
    "expand_urls",
    "is_glob",
    "is_url",
    "local_glob",
    "local_path",
    "locked",
    "open_document",
    "read_each",
    "read_index_file",
    "reads_so_far",
    "storage_failure",
    "storage_for",
    "url_protocols",
    "write_document",
    "write_index_file",
]
