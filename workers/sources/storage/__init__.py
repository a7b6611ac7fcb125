"""The bytes every format reads: local files (``pread``) or fsspec URLs, each object's identity
(size, version), retries of transient failures, the URL patterns a job names, and the index
files that readers map. Runs in the worker (and in ``python -m loader.tars``).

* ``_storage``: :class:`Storage` (local or remote), :func:`storage_for`, identities, retries,
  :class:`StorageFailure`;
* ``_index_file``: index files (a JSON header and numpy arrays in one mapped file) and the lock
  that makes one process build one while the others wait.

May import: the standard library, numpy (fsspec inside functions), :mod:`workers.startup` (the
storage backends a script opens) and :mod:`workers.sources.plan` (the pool's token). Nothing of
the formats (:mod:`workers.sources.files`, :mod:`workers.sources.tars`): they import this.
"""

from ._index_file import locked
from ._index_file import read as read_index_file
from ._index_file import write as write_index_file
from ._storage import (
    AHEAD_BYTES,
    RETRIES,
    Identity,
    IdentityChanged,
    Storage,
    StorageFailure,
    expand_urls,
    is_url,
    local_path,
    storage_failure,
    storage_for,
)

__all__ = [
    "AHEAD_BYTES",
    "RETRIES",
    "Identity",
    "IdentityChanged",
    "Storage",
    "StorageFailure",
    "expand_urls",
    "is_url",
    "local_path",
    "locked",
    "read_index_file",
    "storage_failure",
    "storage_for",
    "write_index_file",
]
