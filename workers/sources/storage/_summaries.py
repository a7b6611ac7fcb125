"""What every format's summary shares (a tar directory's ``loader-summary.json``, a Parquet
directory's ``loader-parquet-summary.json``): its JSON document checked for its format, version
and columns; this node's copy, named by the directory's URL; and its writing, beside the data
or (the store refuses it, or the job was not asked to publish) into that copy. Each format's
own module (``tars._summary``, ``parquet._summary``) says what its entries hold. Runs in the
worker and in the index command.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from ._cache import CACHE_DIR_ENV, cache_dir
from ._storage import Storage

logger = logging.getLogger("workers")


def open_document(
    data: bytes,
    where: str,
    form: str,
    version: int,
    columns: list[str],
    command: str,
    older: tuple[int, ...] = (),
) -> dict[str, Any]:
    """The JSON document of a summary of format ``form``; ``ValueError`` naming ``where`` when
    it is not JSON, not of that format, or of another version (``older``: earlier versions it
    still reads) or columns (then ``command`` is what writes it again)."""
    try:
        document = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{where} is not JSON ({error})") from None
    if not isinstance(document, dict) or document.get("format") != form:
        raise ValueError(f"{where} is not a {form}")
    found = document.get("version")
    if found not in (version, *older) or document.get("columns") != columns:
        raise ValueError(
            f"{where} is a summary of version {document.get('version')!r}; this loader reads "
            f"version {version}: run {command} again"
        )
    return document


def cached_path(storage: Storage, directory: str, folder: str, suffix: str) -> Path:
    """This node's copy of ``directory``'s summary: in the cache's ``folder``, named by a hash
    of the directory's URL (and endpoint), ending in ``suffix``."""
    name = storage.cache_name(directory)
    digest = hashlib.sha256(name.encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return cache_dir(folder) / f"{digest}{suffix}"


def write_document(storage: Storage, url: str | None, cached: Path, data: bytes) -> str:
    """Write a summary's ``data`` at ``url`` (beside the data; None: not there), else, where the
    store refuses it, at ``cached`` (this node's copy, written whole or not at all); returns
    where it went. Raises ``OSError`` when it cannot be written anywhere."""
    if url is not None:
        try:
            storage.write(url, data)
            return url
        except OSError as error:
            logger.info(
                "cannot write %s (%s): keeping the summary in this node's cache", url, error
            )
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        temporary = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
        temporary.write_bytes(data)
        os.replace(temporary, cached)
    except OSError as error:
        beside = f"beside the data ({url}), nor " if url is not None else ""
        raise type(error)(
            f"the summary cannot be written {beside}in this node's cache ({cached.parent}: "
            f"{error.strerror or error}): set {CACHE_DIR_ENV} to a writable directory",
        ) from None
    return str(cached)
