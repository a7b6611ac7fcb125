"""The storage backends and format libraries a worker server imports while it warms: those the
workers of the same script's earlier runs opened.

A worker's first remote read imports its fsspec backend: ``s3fs`` (with aiobotocore and aiohttp)
takes 0.27-0.3 s on the 2-core machine, in each worker, between the loader's construction and its
first batch; a Parquet reader's first plan imports pyarrow (0.05 s). The server cannot tell
before the first loader which backend or reader its workers will need, but the script's earlier
runs can: a worker that opens a backend notes its protocol (:func:`opened`), and a reader that
imports its library notes the module (:func:`used`: only those of :data:`READER_MODULES`), in a
small JSON record for the script, and the next worker server of that script imports them as it
warms (:func:`warm`), usually while the script is still busy with its own set-up; its workers are
forked with them imported.

The record lives in the directory of DALI's source analysis (:mod:`._analysis_cache`),
under its rules and its switch (``DALI_LOADER_ANALYSIS_CACHE=0`` turns both off): one file per
script and interpreter, named by a hash of the main module's path (or name) and of
``sys.executable``; the records of the :data:`~._analysis_cache.MAX_ENTRIES` scripts run
last are kept. A protocol or module no run has used for :data:`FORGET_AFTER` seconds is no longer
imported. Only what fsspec's own registry names is imported, and only its class
(``fsspec.get_filesystem_class``): no client, no connection. A backend whose import started a
thread (which the server's forks would not carry) is dropped from the record, with a warning.

For ``s3://`` the server also loads botocore's data once (the S3 service model, its endpoint
rules, the partitions: :func:`_load_botocore_data`, by making a client it never uses: no request,
no thread); each worker it forks gives that data to the session of its S3 filesystem
(:func:`with_session`), whose client set-up then takes ~0.01 s instead of ~0.1 s on the path to
the first read. Only where s3fs would have made a plain session itself (no ``session`` and no
session keyword among the options) and with the same ``AWS_DATA_PATH``. That session (one a
thread, in every process: the index command's too) also reads the date S3 gives in each
response's headers without dateutil's general parser (:func:`header_timestamp`).
"""

from __future__ import annotations

import contextlib
import email.utils
import functools
import hashlib
import importlib
import inspect
import json
import logging
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
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
#: The record's maps: fsspec protocols, and the readers' format libraries.
_KEYS = ("protocols", "modules")
#: The modules a reader may note with :func:`used` (and a server import ahead): no other name
#: from a record file is ever imported.
READER_MODULES = frozenset({"pyarrow.parquet", "pyarrow.compute"})
#: Each thread's aiobotocore session for s3fs (:func:`_session`), with the pid it was made in.
_sessions = threading.local()
#: Reader modules this process has noted already.
_noted_modules: set[str] = set()


def _record_path(base: Path, script: str) -> Path:
    digest = hashlib.sha256(f"{script}\0{sys.executable}".encode("utf-8", "surrogatepass"))
    return base / (digest.hexdigest()[:32] + _SUFFIX)


def _read(path: Path) -> dict[str, dict[str, float]]:
    """The record: its ``protocols`` and ``modules``, each name with when it was last used;
    empty maps when missing or unreadable."""
    try:
        content = json.loads(path.read_text())
    except (OSError, ValueError):
        content = {}
    record: dict[str, dict[str, float]] = {}
    for key in _KEYS:
        found = content.get(key) if isinstance(content, dict) else None
        record[key] = {
            name: float(when)
            for name, when in (found.items() if isinstance(found, dict) else ())
            if isinstance(name, str) and isinstance(when, (int, float))
        }
    return record


def _write(path: Path, record: dict[str, dict[str, float]]) -> None:
    data = json.dumps({"script": _script, **record}, sort_keys=True).encode()
    if not _analysis_cache.write_whole(path, data):
        logger.debug("storage record %s not written", path)
        return
    _analysis_cache.prune(path.parent, _SUFFIX)  # (the records of the scripts run last)


def _note(key: str, name: str) -> None:
    """Note ``name`` under ``key`` of this script's record (when new to it, or its time old)."""
    base = _analysis_cache.usable_directory(create=True)
    if base is None or _script is None:
        return
    path = _record_path(base, _script)
    record = _read(path)
    now = time.time()
    if now - record[key].get(name, 0.0) < REFRESH_AFTER:
        return
    record[key][name] = now
    _write(path, record)


def opened(protocol: str) -> None:
    """Note that this worker opened a ``protocol`` backend (once per process and protocol; the
    record is written only when that protocol is new to it or its time is old)."""
    if _script is None or protocol in _noted or protocol in _BUILT_IN:
        return
    _noted.add(protocol)
    _note("protocols", protocol)


def used(module: str) -> None:
    """Note that this worker's reader imported ``module`` (one of :data:`READER_MODULES`: a
    format's library, such as ``pyarrow.parquet``), for the script's next server to import."""
    if _script is None or module not in READER_MODULES or module in _noted_modules:
        return
    _noted_modules.add(module)
    _note("modules", module)


def warm(script: str | None, stop: Callable[[], bool] = lambda: False) -> list[str]:
    """In a starting worker server: remember ``script`` (the main module's path or name, for the
    workers' :func:`opened` and :func:`used`), and import the backends and reader modules its
    earlier runs used, until ``stop()`` says a loader's request waits (that request names what
    its workers need: :func:`import_needs`). Returns the protocols and modules imported now."""
    global _script
    _script = script
    if script is None:
        return []
    base = _analysis_cache.usable_directory(create=False)
    if base is None:
        return []
    path = _record_path(base, script)
    record = _read(path)
    if any(record.values()):
        with contextlib.suppress(OSError):
            os.utime(path)  # (used: kept longest)
    recent = {
        key: sorted(name for name, when in names.items() if time.time() - when < FORGET_AFTER)
        for key, names in record.items()
    }
    imported = [
        name
        for name in recent["protocols"]
        if not stop() and _import_ahead(name, path, record, "protocols", _backend_importer(name))
    ]
    if _S3.intersection(imported):
        _load_botocore_data()
    imported += [
        name
        for name in recent["modules"]
        if name in READER_MODULES
        and not stop()
        and _import_ahead(name, path, record, "modules", functools.partial(_import, name))
    ]
    return imported


def import_needs(needs: Sequence[str]) -> list[str]:
    """In a worker server, before it forks a loader's workers: import what that loader's dataset
    definition will open (``protocol:<name>``: fsspec's backend; ``module:<name>``: a reader's
    module among :data:`READER_MODULES`), where not imported yet. Nothing is written to the
    record (the workers note what they really open); one that fails, or starts a thread, is left
    to the workers. Returns what was imported now."""
    done = []
    for need in needs:
        key, _, name = need.partition(":")
        if key == "protocol" and name not in _BUILT_IN:
            importer = _backend_importer(name)
        elif key == "module" and name in READER_MODULES and name not in sys.modules:
            importer = functools.partial(_import, name)
        else:
            continue
        if _import_ahead(name, None, {}, f"{key}s", importer):
            done.append(need)
            if key == "protocol" and name in _S3 and _botocore_data is None:
                _load_botocore_data()
    return done


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
    """``options`` for ``fsspec.filesystem(protocol, ...)``, with this thread's aiobotocore
    session (:func:`_session`: the server's botocore data where it loaded it, and a quick
    parser of the timestamps S3 gives in headers) where s3fs would have made a plain session
    itself; else ``options`` as they are."""
    if protocol not in _S3 or "session" in options:
        return options
    try:
        import s3fs
    except ImportError:
        return options
    named = inspect.signature(s3fs.S3FileSystem.__init__).parameters
    if any(key not in named for key in options):  # (s3fs gives the others to its session)
        return options
    session = _session()
    return options if session is None else {**options, "session": session}


def _session() -> Any:
    """This thread's aiobotocore session for s3fs (one a thread, as botocore asks; the same one
    each time, so that fsspec's cache of filesystems still finds a thread's earlier one): with
    the server's botocore data (:func:`_load_botocore_data`) where it was loaded under the same
    ``AWS_DATA_PATH``, and :func:`header_timestamp` as its clients' timestamp parser. None where
    aiobotocore cannot make one."""
    found = getattr(_sessions, "session", None)
    if found is not None and found[0] == os.getpid():
        return found[1]
    try:
        from aiobotocore.session import AioSession

        session = AioSession()
        if _botocore_data is not None and os.environ.get("AWS_DATA_PATH") == _botocore_data[1]:
            session.register_component("data_loader", _botocore_data[0])
        parsers = session.get_component("response_parser_factory")
        parsers.set_parser_defaults(timestamp_parser=header_timestamp)
    except Exception:  # (s3fs then makes its own, as without this)
        logger.debug("no aiobotocore session made for s3fs", exc_info=True)
        return None
    _sessions.session = (os.getpid(), session)
    return session


def header_timestamp(value: Any) -> Any:
    """botocore's timestamp parser (``botocore.utils.parse_timestamp``), its result unchanged,
    but quick for the form S3 gives in a response's headers (``Last-Modified: Mon, 07 Dec 2026
    16:00:00 GMT``, on every GET and HEAD): botocore reads it with dateutil's general parser,
    ~0.1 ms a response, 12% of the index command's Python time over 2,000 files on S3
    (:mod:`bench.index_scale`). Any other form goes to botocore's parser."""
    from botocore.utils import parse_timestamp, tzutc  # (dateutil's, as botocore's results)

    if isinstance(value, str) and value.endswith(" GMT") and len(value) == 29:
        try:
            parsed = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return parse_timestamp(value)
        return parsed.replace(tzinfo=tzutc())
    return parse_timestamp(value)


def _import(module: str) -> bool:
    importlib.import_module(module)
    return True


def _backend_importer(protocol: str) -> Callable[[], bool]:
    """Imports the class of fsspec's ``protocol`` backend; False when there is none to import."""

    def run() -> bool:
        try:
            import fsspec
            from fsspec.registry import known_implementations
        except ImportError:
            return False
        if protocol in _BUILT_IN or protocol not in known_implementations:
            return False
        fsspec.get_filesystem_class(protocol)
        return True

    return run


def _import_ahead(
    name: str,
    path: Path | None,
    record: dict[str, dict[str, float]],
    key: str,
    importer: Callable[[], bool],
) -> bool:
    """Run ``importer`` (of ``name``, noted under ``key``); one that fails is left to the worker
    that needs it, and one that started a thread is dropped from the record (at ``path``, if
    any), with a warning."""
    threads = set(threading.enumerate())
    started = time.perf_counter()
    what = f"the {name}:// backend" if key == "protocols" else name
    try:
        if not importer():
            return False
    except Exception:  # (uninstalled since: the worker that needs it says so)
        logger.debug("worker server: %s did not import", what, exc_info=True)
        return False
    if set(threading.enumerate()) - threads:
        warnings.warn(
            f"importing {what} started a thread; the worker server no longer imports it ahead "
            "(its forks would not carry the thread)",
            RuntimeWarning,
            stacklevel=2,
        )
        if path is not None:
            del record[key][name]
            _write(path, record)
        return False
    logger.debug(
        "worker server: imported %s in %.2f s (used by this script's last runs)",
        what,
        time.perf_counter() - started,
    )
    return True
