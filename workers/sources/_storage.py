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
import errno
import functools
import inspect
import logging
import os
import posixpath
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import IO, Any, TypeVar

import numpy as np

from .. import startup
from ._control import STARTED_TOGETHER

logger = logging.getLogger("workers")

#: Retries of a remote read that failed for a transient reason (after the first try).
RETRIES = 4
#: Bytes of remote shards a worker fetches ahead of their need, by default (past the first one:
#: ``sharded_tars(ahead_bytes=)``).
AHEAD_BYTES = 256 << 20
#: Seconds before the first retry; doubled for each next one.
BACKOFF = 0.25

_T = TypeVar("_T")

#: What says an object changed: (size, version), the version its ETag or its mtime.
Identity = tuple[int, str]

#: Error class names (of botocore, aiohttp, urllib3...) that mean "try again".
_TRANSIENT_NAMES = (
    "ConnectionError",
    "ConnectionReset",
    "ConnectTimeout",
    "ReadTimeout",
    "Timeout",
    "ServerDisconnected",
    "ClientPayloadError",
    "IncompleteRead",
    "ResponseStreamingError",
    "SlowDown",
    "Throttl",
    "ServiceUnavailable",
    "InternalError",
)
#: Error class names (of botocore, aiohttp) that mean "no connection could be made".
_UNREACHABLE_NAMES = ("EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError")
_TRANSIENT_ERRNOS = {
    errno.ECONNRESET,
    errno.ECONNABORTED,
    errno.ETIMEDOUT,
    errno.EPIPE,
    errno.EAGAIN,
}


class StorageFailure(OSError):
    """A shard could not be read (missing, denied, unreachable after retries, changed while the
    job runs): not a bad sample, so ``on_error="skip"`` does not skip it; it stops the worker."""

    _loader_fatal = True


class IdentityChanged(StorageFailure):
    """A read found the object other than expected: ``found`` is its (size, version) as the
    store answered that read."""

    def __init__(self, path: str, expected: Identity, found: Identity) -> None:
        super().__init__(f"{path} is not the object expected ({expected} -> {found})")
        self.path, self.expected, self.found = path, expected, found


class StorageLibraryError(ImportError):
    """A storage library that a URL's protocol needs (``fsspec``; ``s3fs`` for ``s3://``) is
    missing, or older than the loader's extras allow: named with the version found, the version
    needed and the command that installs it."""


#: The storage libraries each protocol needs and the oldest versions the extras allow
#: (pyproject's ``[s3]`` extra); any other remote protocol needs fsspec.
STORAGE_LIBRARIES: dict[str, tuple[tuple[str, str], ...]] = {
    "s3": (("fsspec", "2023.6"), ("s3fs", "2023.6")),
    "s3a": (("fsspec", "2023.6"), ("s3fs", "2023.6")),
}
_FSSPEC_ONLY = (("fsspec", "2023.6"),)
#: What installs them.
INSTALL_STORAGE = 'pip install "dali-capture-loader[s3]"'


def _version_key(version: str) -> tuple[int, ...]:
    """The leading numbers of a version (``2023.6.0`` -> (2023, 6, 0); ``0.4.2.post1`` ->
    (0, 4, 2)): enough to compare with the extras' floors."""
    numbers = []
    for part in version.split("."):
        digits = ""
        for char in part:
            if not char.isdigit():
                break
            digits += char
        if not digits:
            break
        numbers.append(int(digits))
        if len(digits) != len(part):
            break
    return tuple(numbers)


def storage_library_problem(protocol: str) -> str | None:
    """What is wrong with the storage libraries ``protocol`` needs (read from the installed
    packages' metadata, as the import would find them: nothing is imported), or None."""
    from importlib import metadata
    from importlib.util import find_spec

    if protocol in ("", "file", "local"):
        return None
    for package, needed in STORAGE_LIBRARIES.get(protocol, _FSSPEC_ONLY):
        try:
            found = metadata.version(package)
        except metadata.PackageNotFoundError:
            found = None
        if found is None and find_spec(package) is None:
            return (
                f"reading {protocol}:// URLs needs {package}>={needed}, which is not installed: "
                f"{INSTALL_STORAGE}"
            )
        if found is not None and _version_key(found) < _version_key(needed):
            return (
                f"reading {protocol}:// URLs needs {package}>={needed}; {package} {found} is "
                f"installed (older than the loader's extras allow): {INSTALL_STORAGE}"
            )
    return None


def check_storage_libraries(urls: Iterable[str]) -> None:
    """:class:`StorageLibraryError` when a library that one of ``urls``' protocols needs is
    missing or too old (the first such protocol's; see :func:`storage_library_problem`)."""
    protocols = dict.fromkeys(url.split("://", 1)[0] for url in urls if is_url(url))
    for protocol in protocols:
        problem = storage_library_problem(protocol)
        if problem is not None:
            raise StorageLibraryError(problem)


def is_url(path: str) -> bool:
    """Whether ``path`` is a URL (``proto://...``) rather than a local path."""
    return "://" in path and not path.startswith("file://")


def local_path(path: str) -> str:
    return path[len("file://") :] if path.startswith("file://") else path


def unreachable(error: BaseException) -> bool:
    """Whether ``error`` says the store could not be connected to at all (refused, no route,
    no such host, a connect timeout): the client has retried it already."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (ConnectionRefusedError, socket.gaierror)):
            return True
        if any(name in type(current).__name__ for name in _UNREACHABLE_NAMES):
            return True
        current = current.__cause__ or current.__context__
    return False


def transient(error: BaseException) -> bool:
    """Whether a read that raised ``error`` may succeed if tried again."""
    if isinstance(error, (FileNotFoundError, PermissionError, IsADirectoryError)):
        return False
    if isinstance(error, (ConnectionError, TimeoutError)):
        return True
    if isinstance(error, OSError) and error.errno in _TRANSIENT_ERRNOS:
        return True
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:  # the error and its causes
        seen.add(id(current))
        name = type(current).__name__
        if any(part in name for part in _TRANSIENT_NAMES):
            return True
        current = current.__cause__ or current.__context__
    return False


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
        """Bytes ``[start, end)`` of ``path`` as a uint8 array (one open, ``preadv``, close;
        ``expect`` is not checked: local identities come from the start's listing)."""
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
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

    def open(self, path: str) -> IO[bytes]:
        return open(path, "rb")  # (the caller closes it)

    def read_all(self, path: str) -> bytes:
        with open(path, "rb") as file:
            return file.read()

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
        startup.opened(protocol)  # (the next server of this script imports it ahead)
        _connect_ahead(self.fs, protocol)
        self.protocol, self.retries = protocol, retries
        #: objects whose identity a HEAD confirmed (stores whose reads do not tell it)
        self._checked: set[tuple[str, Identity]] = set()
        client = options.get("client_kwargs") or {}
        self.endpoint = str(
            options.get("endpoint_url")
            or (client.get("endpoint_url") if isinstance(client, dict) else None)
            or f"the default {protocol}:// endpoint"
        )

    def retried(self, what: str, url: str, call: Callable[[], _T]) -> _T:
        """``call()``, tried again on transient errors (see the module docstring). ``what``
        says what it does (``reading bytes 0-512``) in messages. A store that cannot be reached
        at all is not tried again here: the client (botocore) has already retried."""
        delay = BACKOFF
        for attempt in range(self.retries + 1):
            try:
                return call()
            except Exception as error:
                if unreachable(error):
                    raise ConnectionError(
                        f"cannot connect to the store at {self.endpoint} ({what} {url}): "
                        f"{type(error).__name__}: {error}. Check endpoint_url in "
                        "storage_options, and that this host reaches it"
                    ) from error
                if not transient(error) or attempt == self.retries:
                    raise _named(error, what, url) from error
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
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    def read(
        self, path: str, start: int, end: int, expect: Identity | None = None
    ) -> np.ndarray[Any, Any]:
        what = f"reading bytes {start}-{end}"
        if expect is not None and self._s3_reads():
            data, found = self.retried(what, path, lambda: self._s3_read(path, start, end))
            if found != expect:
                raise IdentityChanged(path, expect, found)
        else:
            if expect is not None and (path, expect) not in self._checked:
                found = self.identity(path)  # (no identity with the read: one HEAD per object)
                if found != expect:
                    raise IdentityChanged(path, expect, found)
                self._checked.add((path, expect))
            data = self.retried(what, path, lambda: self.fs.cat_file(path, start=start, end=end))
        if len(data) != end - start:
            raise EOFError(
                f"{path} gave {len(data)} bytes at {start}, not {end - start}: the object was "
                "truncated or replaced since it was indexed"
            )
        return np.frombuffer(data, dtype=np.uint8)

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

        bucket, key, version = self.fs.split_path(path)
        extra = {"VersionId": version} if version else {}
        if end is not None:
            extra["Range"] = f"bytes={start}-{end - 1}"

        async def get() -> tuple[bytes, dict[str, Any]]:
            response: dict[str, Any] = await self.fs._call_s3(
                "get_object", Bucket=bucket, Key=key, **extra
            )
            try:
                body: bytes = await response["Body"].read()
            finally:
                response["Body"].close()
            return body, response

        data, response = sync(self.fs.loop, get)
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
            if entry.get("type", "file") == "file":
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
    """What changes when an object is rewritten: its ETag, else its modification time."""
    for key in ("ETag", "etag", "VersionId", "LastModified", "mtime", "last_modified"):
        value = entry.get(key)
        if value:
            return f"{key}:{str(value).strip(chr(34))}"
    return ""


def _named(error: Exception, what: str, url: str) -> Exception:
    """``error`` as raised to the user: the same type where it can carry the URL, with it."""
    if isinstance(error, FileNotFoundError):
        return FileNotFoundError(errno.ENOENT, f"{url} does not exist ({what})")
    if isinstance(error, PermissionError):
        return PermissionError(
            errno.EACCES, f"access to {url} was denied ({what}: {error}); check the credentials"
        )
    return OSError(f"{url}: {what} failed: {type(error).__name__}: {error}")


def storage_failure(url: str, error: BaseException) -> StorageFailure:
    """A :class:`StorageFailure` for ``url`` that says what ``error`` says once, readably."""
    text = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
    return StorageFailure(text if url in text else f"cannot read {url}: {text}")


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


def expand_urls(urls: str | Iterable[str]) -> list[str]:
    """A list of paths/URLs, or one with WebDataset brace patterns expanded:
    ``train-{000000..000127}.tar`` (zero-padded ranges) and ``{a,b}`` (alternatives)."""
    items = [urls] if isinstance(urls, (str, os.PathLike)) else list(urls)
    expanded: list[str] = []
    for item in items:
        if not isinstance(item, (str, os.PathLike)):
            raise TypeError(f"a shard's path or URL must be a str, got {type(item).__name__}")
        expanded.extend(_braces(os.fspath(item)))
    if not expanded:
        raise ValueError("no shards: the list of tar paths/URLs is empty")
    return expanded


def _braces(pattern: str) -> list[str]:
    start = pattern.find("{")
    if start < 0:
        if "}" in pattern:
            raise ValueError(f"unbalanced braces in the shard pattern {pattern!r}")
        return [pattern]
    end = pattern.find("}", start)
    if end < 0:
        raise ValueError(f"unbalanced braces in the shard pattern {pattern!r}")
    inside, rest = pattern[start + 1 : end], _braces(pattern[end + 1 :])
    head = pattern[:start]
    if ".." in inside:
        low, _, high = inside.partition("..")
        if not (low.isdigit() and high.isdigit()) or int(low) > int(high):
            raise ValueError(
                f"the range {{{inside}}} in {pattern!r} must be {{first..last}} of integers, "
                "first <= last"
            )
        width = len(low) if low.startswith("0") else 0
        options = [str(number).zfill(width) for number in range(int(low), int(high) + 1)]
    else:
        options = inside.split(",")
    return [head + option + tail for option in options for tail in rest]
