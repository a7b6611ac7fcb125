"""Where sources read bytes: local files or any fsspec URL (``s3://``...). Runs in the worker.

One small layer the tar source (and whatever reads more than whole local files) shares:

* :func:`storage_for` picks :class:`LocalStorage` for a path (or ``file://``) and
  :class:`RemoteStorage` for any other URL, through ``fsspec`` (``s3://`` needs ``s3fs``;
  ``storage_options`` go to the filesystem as they are).
* Both read a byte range (:meth:`read`) or a whole small object (:meth:`read_all`), stream an
  object from its start (:meth:`open`), write a small object (:meth:`write`: an index or a summary
  beside the shards), and tell an object's *identity* (size and mtime locally; size and ETag, or
  mtime, remotely), which says when an index or a summary is stale. Identities come from one
  listing per directory (:meth:`listing`), or from a summary, not one request per object; a
  read given the identity it expects checks it (on S3 from the GET's own response).
* A remote read that fails for a transient reason (connection reset, timeout, throttling) is tried
  again with backoff, :data:`RETRIES` times, each retry logged; a missing object, a denied access or
  a bad endpoint is not transient and is raised at once, naming the URL.
"""

from __future__ import annotations

import contextlib
import functools
import glob as globbing
import inspect
import logging
import os
import posixpath
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO, Any, TypeVar

import numpy as np

from ... import startup
from ..plan import STARTED_TOGETHER
from ._failures import (
    Identity,
    IdentityChanged,
    named,
    transient,
    unreachable,
)
from ._libraries import StorageLibraryError, storage_library_problem

logger = logging.getLogger("workers")

#: Retries of a remote read that failed for a transient reason (after the first try).
RETRIES = 4
#: Bytes of remote shards a worker fetches ahead of their need, by default (past the first one:
#: ``sharded_tars(ahead_bytes=)``).
AHEAD_BYTES = 256 << 20
#: Seconds before the first retry; doubled for each next one.
BACKOFF = 0.25

_T = TypeVar("_T")


def is_url(path: str) -> bool:
    """Whether ``path`` is a URL (``proto://...``) rather than a local path."""
    return "://" in path and not path.startswith("file://")


def local_path(path: str) -> str:
    return path[len("file://") :] if path.startswith("file://") else path


class Storage:
    """Byte access to the objects of one filesystem."""

    #: reads by byte range are cheap (a local file): no need to fetch whole objects ahead
    local = True

    def read_tells(self, identity: Identity) -> bool:
        """Whether a read with ``expect=identity`` checks it at no cost (see :meth:`read`)."""
        return False

    def can_check(self, identity: Identity) -> bool:
        """Whether a read with ``expect=identity`` checks it at all."""
        return False

    def read(
        self, path: str, start: int, end: int, expect: Identity | None = None
    ) -> np.ndarray[Any, Any]:
        """Bytes ``[start, end)`` of ``path``; with ``expect`` (remote objects), the object's
        identity as the store answers the read is checked against it (:class:`IdentityChanged`
        when it differs; on S3 the ranged GET's own ETag and size: no other request)."""
        raise NotImplementedError

    def open(self, path: str) -> IO[bytes]:
        raise NotImplementedError

    def read_all(self, path: str) -> bytes:
        """The whole (small) object; ``FileNotFoundError`` when there is none."""
        raise NotImplementedError

    def glob(self, pattern: str) -> list[str]:
        """The paths or URLs of the objects ``pattern`` (with ``*``, ``?`` or ``[...]``)
        matches, sorted."""
        raise NotImplementedError

    def write(self, path: str, data: bytes) -> None:
        """Put ``data`` at ``path`` whole (a reader never sees a part of it);
        ``PermissionError`` (or another ``OSError``) where it cannot be written."""
        raise NotImplementedError

    def listing(self, directory: str) -> dict[str, Identity] | None:
        """The identity of each object in ``directory`` by its name (fresh, not cached); None
        where the directory cannot be listed (then :meth:`identities` asks each object)."""
        raise NotImplementedError

    def identities(self, paths: Sequence[str]) -> list[Identity]:
        """(size, version) of each object; ``FileNotFoundError`` naming the first missing one."""
        listings = {d: self.listing(d) for d in dict.fromkeys(self.dirname(p) for p in paths)}
        found = []
        for path in paths:
            listed = listings[self.dirname(path)]
            identity = None if listed is None else listed.get(self.basename(path))
            found.append(identity if identity is not None else self.identity(path))
        return found

    def identity(self, path: str) -> Identity:
        """(size, version) of one object; ``FileNotFoundError`` naming it when it is missing."""
        raise NotImplementedError

    def cache_name(self, path: str) -> str:
        """What names ``path`` in this node's cache (the indexes and summaries a job keeps
        there): a local file's real path; a remote object's URL with the endpoint that serves
        it, so that one bucket name on two stores never shares an entry."""
        return os.path.realpath(local_path(path) or ".")

    @staticmethod
    def dirname(path: str) -> str:
        return posixpath.dirname(local_path(path)) if is_url(path) else os.path.dirname(path)

    @staticmethod
    def basename(path: str) -> str:
        return posixpath.basename(path)

    @staticmethod
    def join(directory: str, name: str) -> str:
        return f"{directory.rstrip('/')}/{name}" if directory else name


class LocalStorage(Storage):
    """Local files, read with ``pread``."""

    local = True

    def read(
        self, path: str, start: int, end: int, expect: Identity | None = None
    ) -> np.ndarray[Any, Any]:
        """Bytes ``[start, end)`` of ``path`` as a uint8 array (one open, ``preadv``, close);
        with ``expect``, the file's size and mtime as it is opened (one ``fstat``) are checked
        against it: a file replaced since the plan, even by one of the same size, is named."""
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if expect is not None:
                found = _local_identity(os.fstat(fd))
                if found != expect:
                    raise IdentityChanged(path, expect, found)
            data = np.empty(end - start, dtype=np.uint8)
            done = 0
            while done < data.size:
                more = os.preadv(fd, [data[done:].data], start + done)
                if more == 0:
                    raise EOFError(
                        f"{path} ends at byte {start + done}, before {end}: the file was "
                        "truncated or rewritten since it was indexed"
                    )
                done += more
            return data
        finally:
            os.close(fd)

    def can_check(self, identity: Identity) -> bool:
        return identity[1].startswith("mtime:")

    def open(self, path: str) -> IO[bytes]:
        return open(path, "rb")  # (the caller closes it)

    def read_all(self, path: str) -> bytes:
        with open(path, "rb") as file:
            return file.read()

    def glob(self, pattern: str) -> list[str]:
        return sorted(globbing.glob(local_path(pattern), recursive=True))

    def write(self, path: str, data: bytes) -> None:
        temporary = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(temporary, "wb") as out:
                out.write(data)
            os.replace(temporary, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)

    def listing(self, directory: str) -> dict[str, Identity] | None:
        found: dict[str, Identity] = {}
        try:
            with os.scandir(directory or ".") as entries:
                for entry in entries:
                    with contextlib.suppress(OSError):  # (gone since the listing)
                        if entry.is_file():
                            found[entry.name] = _local_identity(entry.stat())
        except (FileNotFoundError, NotADirectoryError):
            return {}
        except OSError:
            return None
        return found

    def identity(self, path: str) -> Identity:
        return _local_identity(os.stat(path))


def _connect_ahead(fs: Any, protocol: str) -> None:
    """In a loader's worker building its sources: set up the client of a filesystem that does so
    at its first call (s3fs's ``set_session``: botocore's service model, the credentials, the
    endpoint; 0.1-0.2 s) on a thread of its own while the worker goes on (waiting for the node's
    summary, planning), so that its first read finds it ready. Only where the filesystem guards
    that set-up with a lock (s3fs 2025 and later), which makes a read wait for a set-up under way
    instead of starting a second client; a failure here is left to that read to report."""
    set_session = getattr(fs, "set_session", None)
    if (
        not STARTED_TOGETHER.get()
        or not inspect.iscoroutinefunction(set_session)
        or getattr(fs, "_set_session_lock", None) is None
    ):
        return

    def connect() -> None:
        from fsspec.asyn import sync

        try:
            sync(fs.loop, set_session)
        except Exception:
            logger.debug("the %s:// client was not set up ahead", protocol, exc_info=True)

    threading.Thread(target=connect, name="dali-loader-connect", daemon=True).start()


class RemoteStorage(Storage):
    """Objects behind an fsspec filesystem (``s3://`` through ``s3fs``...)."""

    local = False

    def __init__(self, protocol: str, options: dict[str, Any], retries: int = RETRIES) -> None:
        problem = storage_library_problem(protocol)
        if problem is not None:
            raise StorageLibraryError(problem)
        try:
            import fsspec
        except ImportError as error:  # pragma: no cover - fsspec is installed with the extra
            raise ImportError(
                f"reading {protocol}:// URLs needs fsspec (and s3fs for s3://): "
                "pip install 'dali-capture-loader[s3]'"
            ) from error
        try:
            self.fs = fsspec.filesystem(protocol, **startup.with_session(protocol, options))
        except ImportError as error:
            raise ImportError(
                f"reading {protocol}:// URLs needs the fsspec backend for {protocol} "
                f"({error}); for s3:// install s3fs: pip install 'dali-capture-loader[s3]'"
            ) from error
        if isinstance(getattr(self.fs, "retries", None), int) and "retries" not in options:
            self.fs.retries = 1  # (s3fs's 2 nested layers of 5 tries: a lasting 503 asked 125x)
        startup.opened(protocol)  # (the next server of this script imports it ahead)
        _connect_ahead(self.fs, protocol)
        self.protocol, self.retries = protocol, retries
        #: what makes a ranged read fetch the range and no more (huggingface_hub's files read a
        #: block ahead of each read by default)
        self._exact_reads: dict[str, Any] = {"cache_type": "none"} if protocol == "hf" else {}
        #: objects whose identity a HEAD confirmed (stores whose reads do not tell it)
        self._checked: set[tuple[str, Identity]] = set()
        client = options.get("client_kwargs") or {}
        self.endpoint = str(
            options.get("endpoint_url")
            or (client.get("endpoint_url") if isinstance(client, dict) else None)
            # (huggingface_hub's: its ``endpoint`` option, else HF_ENDPOINT or the Hub)
            or (getattr(self.fs, "endpoint", None) if protocol == "hf" else None)
            or f"the default {protocol}:// endpoint"
        )

    def cache_name(self, path: str) -> str:
        return f"{self.endpoint}\0{path}"

    def retried(self, what: str, url: str, call: Callable[[], _T]) -> _T:
        """``call()``, tried again on transient errors (see the module docstring). ``what``
        says what it does (``reading bytes 0-512``) in messages. A store that cannot be reached
        at all is not tried again here: the client (botocore) has already retried."""
        delay = BACKOFF
        for attempt in range(self.retries + 1):
            try:
                return call()
            except Exception as error:
                self.after_failure(error, attempt, delay, what, url)
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    def after_failure(
        self, error: Exception, attempt: int, delay: float, what: str, url: str
    ) -> None:
        """Of :meth:`retried` (and its asynchronous form): raise the error to give for
        ``error`` on try ``attempt`` (none left, not transient, or the store unreachable), else
        log that it is tried again after ``delay`` seconds."""
        if unreachable(error):
            raise ConnectionError(
                f"cannot connect to the store at {self.endpoint} ({what} {url}): "
                f"{type(error).__name__}: {error}. Check endpoint_url in "
                "storage_options, and that this host reaches it"
            ) from error
        if not transient(error) or attempt == self.retries:
            raise named(error, what, url) from error
        logger.warning(
            "%s: %s failed (%s: %s); trying again in %.2f s (%d of %d)",
            url,
            what,
            type(error).__name__,
            error,
            delay,
            attempt + 1,
            self.retries,
        )

    def read(
        self, path: str, start: int, end: int, expect: Identity | None = None
    ) -> np.ndarray[Any, Any]:
        what = f"reading bytes {start}-{end}"
        if expect is not None and self._s3_reads():
            try:
                data, found = self.retried(what, path, lambda: self._s3_read(path, start, end))
            except OSError as error:
                # (a 416 may mean the object was cut; a store that kept failing is not asked)
                if not isinstance(error, (ConnectionError, FileNotFoundError)) and not transient(
                    error
                ):
                    self._raise_if_changed(path, expect, error)
                raise
            if found != expect:
                raise IdentityChanged(path, expect, found)
        else:
            if expect is not None and (path, expect) not in self._checked:
                found = self.identity(path)  # (no identity with the read: one HEAD per object)
                if found != expect:
                    raise IdentityChanged(path, expect, found)
                self._checked.add((path, expect))
            exact = self._exact_reads
            data = self.retried(
                what, path, lambda: self.fs.cat_file(path, start=start, end=end, **exact)
            )
        if len(data) != end - start:
            raise EOFError(
                f"{path} gave {len(data)} bytes at {start}, not {end - start}: the object was "
                "truncated or replaced since it was indexed"
            )
        return np.frombuffer(data, dtype=np.uint8)

    def _raise_if_changed(self, path: str, expect: Identity, error: OSError) -> None:
        """After a read of ``path`` failed with ``error``: :class:`IdentityChanged` where the
        object is no longer the one expected (a range past the end of an object cut short is
        refused, 416, before any response tells its identity), asked of the store afresh."""
        try:
            self.fs.invalidate_cache(path)
            found = self.identity(path)
        except Exception:  # (the store says no more: the read's own error stands)
            return
        if found != expect:
            raise IdentityChanged(path, expect, found) from error

    def _s3_reads(self) -> bool:
        """Whether reads can tell the object's identity (s3fs: the GET's ETag and size)."""
        return hasattr(self.fs, "_call_s3") and hasattr(self.fs, "split_path")

    def read_tells(self, identity: Identity) -> bool:
        """Whether a read tells an identity of this kind itself (S3: its ETag and size)."""
        return self._s3_reads() and identity[1].startswith("ETag:")

    def can_check(self, identity: Identity) -> bool:
        """Whether a read can check an identity of this kind: on S3 ETags, not mtimes written
        where the objects were files; elsewhere with a HEAD of the object first."""
        return not self._s3_reads() or identity[1].startswith("ETag:")

    def _s3_read(self, path: str, start: int, end: int | None) -> tuple[bytes, Identity]:
        """One GET (of bytes ``[start, end)``; ``end=None``: the whole object): its bytes, and
        the object's (size, ETag) as that response tells."""
        from fsspec.asyn import sync

        found: tuple[bytes, Identity] = sync(self.fs.loop, self.s3_get, path, start, end)
        return found

    async def s3_get(self, path: str, start: int, end: int | None) -> tuple[bytes, Identity]:
        """:meth:`_s3_read` on the filesystem's event loop (s3fs)."""
        bucket, key, version = self.fs.split_path(path)
        extra = {"VersionId": version} if version else {}
        if end is not None:
            extra["Range"] = f"bytes={start}-{end - 1}"
        response: dict[str, Any] = await self.fs._call_s3(
            "get_object", Bucket=bucket, Key=key, **extra
        )
        try:
            data: bytes = await response["Body"].read()
        finally:
            response["Body"].close()
        total = str(response.get("ContentRange") or "").rpartition("/")[2]
        size = int(total) if total.isdigit() else int(response.get("ContentLength") or 0)
        return data, (size, _version({"ETag": response.get("ETag")}))

    def open(self, path: str) -> IO[bytes]:
        opened: IO[bytes] = self.retried(
            "opening", path, lambda: self.fs.open(path, "rb", block_size=8 << 20)
        )
        return opened

    def read_all(self, path: str) -> bytes:
        if self._s3_reads():  # (one GET: s3fs's cat_file asks the size first)
            return self.retried("reading", path, lambda: self._s3_read(path, 0, None))[0]
        data: bytes = self.retried("reading", path, functools.partial(self.fs.cat_file, path))
        return data

    def glob(self, pattern: str) -> list[str]:
        """The URLs of the objects ``pattern`` (a URL with ``*``, ``?`` or ``[...]``) matches,
        sorted; its listings retried as reads are."""
        found = self.retried("listing", pattern, functools.partial(self._glob, pattern))
        prefix = f"{self.protocol}://"
        return sorted(m if "://" in m else prefix + m for m in found)

    def write(self, path: str, data: bytes) -> None:
        self.retried("writing", path, functools.partial(self.fs.pipe_file, path, data))

    def listing(self, directory: str) -> dict[str, Identity] | None:
        """One listing of ``directory`` (paged by the store: 1,000 objects a request on S3)."""
        stripped = self._strip(directory)
        named = f"{self.protocol}://{stripped}/"
        try:
            entries = self.retried("listing", named, functools.partial(self._ls, stripped))
        except FileNotFoundError:
            return {}
        except PermissionError:  # no listing here: ask each object
            return None
        found: dict[str, Identity] = {}
        for entry in entries:
            # (a file's own URL lists the file itself: it is no directory's member)
            if entry.get("type", "file") == "file" and self._strip(entry["name"]) != stripped:
                name = posixpath.basename(self._strip(entry["name"]))
                found[name] = (int(entry.get("size") or 0), _version(entry))
        return found

    def identity(self, path: str) -> Identity:
        entry = self.retried("finding", path, functools.partial(self._info, path))
        return (int(entry.get("size") or 0), _version(entry))

    def _ls(self, directory: str) -> list[dict[str, Any]]:
        self.fs.invalidate_cache(directory)  # (a listing made earlier in this process is old)
        entries: list[dict[str, Any]] = self.fs.ls(directory, detail=True)
        return entries

    def _glob(self, pattern: str) -> list[str]:
        """The objects (not the directories) ``pattern`` matches."""
        matches = self.fs.glob(pattern, detail=True)
        return [name for name, entry in matches.items() if entry.get("type", "file") == "file"]

    def _info(self, path: str) -> dict[str, Any]:
        entry: dict[str, Any] = self.fs.info(path)
        return entry

    def _strip(self, path: str) -> str:
        stripped: str = self.fs._strip_protocol(path)
        return stripped.rstrip("/")


def _local_identity(stat: os.stat_result) -> Identity:
    """A local file's (size, version): its mtime, not its inode, so a copy that keeps mtimes
    (``cp -a``, ``rsync -a``) keeps its indexes and summary."""
    return (stat.st_size, f"mtime:{stat.st_mtime_ns}")


def _version(entry: dict[str, Any]) -> str:
    """What changes when an object is rewritten: its ETag; on the Hugging Face Hub its LFS
    content hash, else its git blob id (else its Xet hash); else its modification time."""
    lfs = entry.get("lfs")
    sha256 = (lfs.get("sha256") or lfs.get("oid")) if isinstance(lfs, dict) else None
    if sha256:
        return f"sha256:{sha256}"
    for key in _VERSION_KEYS:
        value = entry.get(key)
        if value:
            return f"{key}:{str(value).strip(chr(34))}"
    return ""


#: The keys of a listing's entry that tell an object's version, the first found used (s3fs's,
#: huggingface_hub's, then the modification times of other filesystems).
_VERSION_KEYS = (
    "ETag",
    "etag",
    "blob_id",
    "xet_hash",
    "VersionId",
    "LastModified",
    "mtime",
    "last_modified",
)


_cache: dict[tuple[str, str, int], Storage] = {}


def storage_for(
    path: str, options: dict[str, Any] | None = None, retries: int = RETRIES
) -> Storage:
    """The storage that reads ``path`` (one per protocol, options and retries in a process);
    ``retries``: of a remote read that failed for a transient reason."""
    if not is_url(path):
        return _cache.setdefault(("", "", 0), LocalStorage())
    protocol = path.split("://", 1)[0]
    key = (protocol, repr(sorted((options or {}).items())), retries)
    storage = _cache.get(key)
    if storage is None:
        storage = _cache[key] = RemoteStorage(protocol, dict(options or {}), retries)
    return storage
