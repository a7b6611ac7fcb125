"""The storage backends a worker server imports while it warms: those the workers of the same
script's earlier runs opened.

A worker's first remote read imports its fsspec backend: ``s3fs`` (with aiobotocore and aiohttp)
takes 0.27-0.3 s on the 2-core machine, in each worker, between the loader's construction and its
first batch. The server cannot tell before the first loader which backend its workers will open,
but the script's earlier runs can: a worker that opens one notes its protocol (:func:`opened`) in
a small JSON record for the script, and the next worker server of that script imports those
backends as it warms (:func:`warm`), usually while the script is still busy with its own set-up;
its workers are forked with them imported.

The record lives in the directory of DALI's source analysis (:mod:`._analysis_cache`),
under its rules and its switch (``DALI_LOADER_ANALYSIS_CACHE=0`` turns both off): one file per
script and interpreter, named by a hash of the main module's path (or name) and of
``sys.executable``; the records of the :data:`~._analysis_cache.MAX_ENTRIES` scripts run
last are kept. A protocol no run has opened for :data:`FORGET_AFTER` seconds is no longer
imported. Only what fsspec's own registry names is imported, and only its class
(``fsspec.get_filesystem_class``): no client, no connection. A backend whose import started a
thread (which the server's forks would not carry) is dropped from the record, with a warning.

For ``s3://`` the server also loads botocore's data once (the S3 service model, its endpoint
rules, the partitions: :func:`_load_botocore_data`, by making a client it never uses: no request,
no thread); each worker it forks gives that data to the session of its S3 filesystem
(:func:`with_session`), whose client set-up then takes ~0.01 s instead of ~0.1 s on the path to
the first read. Only where s3fs would have made a plain session itself (no ``session`` and no
session keyword among the options) and with the same ``AWS_DATA_PATH``.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import logging
import os
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

from . import _analysis_cache

logger = logging.getLogger("loader")

#: Seconds after its last use a protocol is no longer imported by a starting server.
FORGET_AFTER = 30 * 24 * 3600.0
#: A worker writes the record again when its protocol's time is older than this (seconds).
REFRESH_AFTER = 24 * 3600.0
_SUFFIX = ".storage.json"
#: Protocols whose backend is part of fsspec or Python itself: nothing to import ahead.
_BUILT_IN = frozenset({"file", "local", "memory"})

#: The script this process works for (the server sets it, its forked workers inherit it).
_script: str | None = None
#: Protocols this process has noted already.
_noted: set[str] = set()
#: botocore's data loader with the S3 client's data loaded (the server's, inherited by its
#: workers), and the ``AWS_DATA_PATH`` it was loaded under; None: not loaded
_botocore_data: tuple[Any, str | None] | None = None
#: Protocols served by s3fs.
_S3 = frozenset({"s3", "s3a"})


def _record_path(base: Path, script: str) -> Path:
    digest = hashlib.sha256(f"{script}\0{sys.executable}".encode("utf-8", "surrogatepass"))
    return base / (digest.hexdigest()[:32] + _SUFFIX)


def _read(path: Path) -> dict[str, float]:
    """The record's protocols and when each was last opened; empty when missing or unreadable."""
    try:
        content = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    protocols = content.get("protocols") if isinstance(content, dict) else None
    if not isinstance(protocols, dict):
        return {}
    return {
        name: float(when)
        for name, when in protocols.items()
        if isinstance(name, str) and isinstance(when, (int, float))
    }


def _write(path: Path, protocols: dict[str, float]) -> None:
    data = json.dumps({"script": _script, "protocols": protocols}, sort_keys=True).encode()
    if not _analysis_cache.write_whole(path, data):
        logger.debug("storage record %s not written", path)
        return
    _analysis_cache.prune(path.parent, _SUFFIX)  # (the records of the scripts run last)


def opened(protocol: str) -> None:
    """Note that this worker opened a ``protocol`` backend (once per process and protocol; the
    record is written only when that protocol is new to it or its time is old)."""
    if _script is None or protocol in _noted or protocol in _BUILT_IN:
        return
    _noted.add(protocol)
    base = _analysis_cache.usable_directory(create=True)
    if base is None:
        return
    path = _record_path(base, _script)
    protocols = _read(path)
    now = time.time()
    if now - protocols.get(protocol, 0.0) < REFRESH_AFTER:
        return
    protocols[protocol] = now
    _write(path, protocols)


def warm(script: str | None) -> list[str]:
    """In a starting worker server: remember ``script`` (the main module's path or name, for the
    workers' :func:`opened`), and import the backends its earlier runs opened. Returns the
    protocols whose backend is imported now."""
    global _script
    _script = script
    if script is None:
        return []
    base = _analysis_cache.usable_directory(create=False)
    if base is None:
        return []
    path = _record_path(base, script)
    protocols = _read(path)
    if protocols:
        with contextlib.suppress(OSError):
            os.utime(path)  # (used: kept longest)
    recent = [name for name, when in protocols.items() if time.time() - when < FORGET_AFTER]
    imported = [name for name in sorted(recent) if _import_backend(name, path, protocols)]
    if _S3.intersection(imported):
        _load_botocore_data()
    return imported


def _load_botocore_data() -> None:
    """Load what an S3 client's set-up reads from botocore's data files, into a data loader that
    the workers' sessions share (:func:`with_session`): by making a client, with placeholder
    credentials, that is never used."""
    global _botocore_data
    threads = set(threading.enumerate())
    try:
        import botocore.loaders
        import botocore.session

        session = botocore.session.Session()
        loader = botocore.loaders.create_loader(session.get_config_variable("data_path"))
        session.register_component("data_loader", loader)
        session.create_client(
            "s3",
            region_name="us-east-1",
            aws_access_key_id="unused",
            aws_secret_access_key="unused",
        )
    except Exception:  # (the workers' sessions load it themselves)
        logger.debug("worker server: botocore's S3 data was not loaded ahead", exc_info=True)
        return
    if set(threading.enumerate()) - threads:  # (not seen: botocore's clients start none)
        return
    _botocore_data = (loader, os.environ.get("AWS_DATA_PATH"))


def with_session(protocol: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` for ``fsspec.filesystem(protocol, ...)``, with an aiobotocore session that
    has the server's botocore data (:func:`_load_botocore_data`) where s3fs would have made a
    plain session itself; else ``options`` as they are."""
    if (
        _botocore_data is None
        or protocol not in _S3
        or "session" in options
        or os.environ.get("AWS_DATA_PATH") != _botocore_data[1]
    ):
        return options
    try:
        import s3fs
        from aiobotocore.session import AioSession
    except ImportError:
        return options
    named = inspect.signature(s3fs.S3FileSystem.__init__).parameters
    if any(key not in named for key in options):  # (s3fs gives the others to its session)
        return options
    session = AioSession()
    session.register_component("data_loader", _botocore_data[0])
    return {**options, "session": session}


def _import_backend(protocol: str, path: Path, protocols: dict[str, float]) -> bool:
    try:
        import fsspec
        from fsspec.registry import known_implementations
    except ImportError:
        return False
    if protocol in _BUILT_IN or protocol not in known_implementations:
        return False
    threads = set(threading.enumerate())
    started = time.perf_counter()
    try:
        fsspec.get_filesystem_class(protocol)
    except Exception:  # (uninstalled since: the worker that needs it says so)
        logger.debug("worker server: the %s:// backend did not import", protocol, exc_info=True)
        return False
    if set(threading.enumerate()) - threads:
        warnings.warn(
            f"importing the {protocol}:// backend started a thread; the worker server no longer "
            "imports it ahead (its forks would not carry the thread)",
            RuntimeWarning,
            stacklevel=2,
        )
        del protocols[protocol]
        _write(path, protocols)
        return False
    logger.debug(
        "worker server: imported the %s:// backend in %.2f s (opened by this script's last runs)",
        protocol,
        time.perf_counter() - started,
    )
    return True
