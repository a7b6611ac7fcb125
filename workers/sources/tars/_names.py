"""The shards a job's ``urls`` name, with the URL grammar of the Parquet source: a shard, a
directory (its ``*.tar`` files in name order), a glob (its ``*.tar`` matches in name order),
brace patterns, or a list of these; local paths or fsspec URLs. Only ``*.tar`` files are taken
from a directory or a glob: what lies beside the shards (img2dataset's ``.parquet`` and
``_stats.json``, the loader's ``.idx`` files and summary) never is. Runs in the worker (and in
``python -m loader.tars index``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from ..storage import RETRIES, expand_urls, is_glob, is_url, local_glob, local_path, storage_for

#: Characters that make a name a glob.
_TAR = ".tar"


def shard_names(
    urls: str | os.PathLike[str] | Iterable[str],
    storage_options: dict[str, Any] | None = None,
    retries: int = RETRIES,
) -> list[str]:
    """The shards ``urls`` names, in order (directories and globs expanded); a
    ``FileNotFoundError`` for a directory or glob that gives none, saying what it holds."""
    found: list[str] = []
    for item in expand_urls(urls):
        if is_url(item) and not item.startswith("file://"):
            found.extend(_remote(item, storage_options, retries))
        else:
            found.extend(_local(local_path(item)))
    return found


def _none_found(where: str, names: list[str]) -> FileNotFoundError:
    others = sorted({os.path.splitext(name)[1] or name for name in names})
    holds = f"; it holds {len(names)} other file(s) ({', '.join(others[:6])})" if names else ""
    return FileNotFoundError(f"no *.tar shard in {where}{holds}")


def _local(path: str) -> list[str]:
    matches = local_glob(path)
    if matches is not None:
        tars = [m for m in matches if m.endswith(_TAR) and os.path.isfile(m)]
        if not tars:
            raise _none_found(f"the matches of {path}", matches)
        return tars
    if os.path.isdir(path):
        names = sorted(os.listdir(path))
        tars = [n for n in names if n.endswith(_TAR) and os.path.isfile(os.path.join(path, n))]
        if not tars:
            raise _none_found(f"the directory {path}", names)
        return [os.path.join(path, name) for name in tars]
    return [path]


def _remote(url: str, storage_options: dict[str, Any] | None, retries: int) -> list[str]:
    if is_glob(url):
        matches = storage_for(url, storage_options, retries).glob(url)
        tars = [m for m in matches if m.endswith(_TAR)]
        if not tars:
            raise _none_found(f"the matches of {url}", [m.rsplit("/", 1)[-1] for m in matches])
        return tars
    if url.endswith(_TAR):
        return [url]
    storage = storage_for(url, storage_options, retries)
    listed = storage.listing(url.rstrip("/")) or {}
    names = sorted(listed)
    tars = [name for name in names if name.endswith(_TAR)]
    if tars:
        return [storage.join(url.rstrip("/"), name) for name in tars]
    if names:
        raise _none_found(f"the directory {url}", names)
    return [url]  # (an object: read as a shard, or named missing)
