"""What a failed request to a store is: an object's *identity* (size, version), the
:class:`StorageFailure` a worker stops on, and which errors are worth trying again (transient) or
mean the store cannot be reached at all. Runs in the worker.

The retries themselves are :meth:`RemoteStorage.retried`'s (:mod:`._storage`); this module says
what they retry and how an error that is not retried reaches the user (:func:`named`,
:func:`storage_failure`: the URL in the message, the type kept where it can carry it).
"""

from __future__ import annotations

import errno
import socket

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
#: HTTP statuses that mean "try again": a request timeout, throttling (429 Too Many Requests,
#: S3's 503 SlowDown) and a server's passing failures.
TRANSIENT_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
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
        super().__init__(f"{path} is not the object expected ({self.change(expected, found)})")
        self.path, self.expected, self.found = path, expected, found

    @staticmethod
    def change(expected: Identity, found: Identity) -> str:
        """``23314 bytes, ETag:909d... -> 13988 bytes, ETag:aa73...``: what an identity was and
        what it is."""
        return " -> ".join(f"{size} bytes, {version}" for size, version in (expected, found))


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


def http_status(error: BaseException) -> int | None:
    """The HTTP status of the response ``error`` was raised for, where it tells one: botocore's
    ``ClientError`` (s3fs) in its response's metadata, ``huggingface_hub``'s ``HfHubHTTPError``
    (and httpx's and requests' errors) in its response's ``status_code``, aiohttp's
    ``ClientResponseError`` (fsspec's HTTP filesystem) in its ``status``."""
    response = getattr(error, "response", None)
    if isinstance(response, dict):
        metadata = response.get("ResponseMetadata")
        status = metadata.get("HTTPStatusCode") if isinstance(metadata, dict) else None
    elif response is not None:
        status = getattr(response, "status_code", None)
    else:
        status = getattr(error, "status", None)
    if isinstance(status, int) and not isinstance(status, bool) and 100 <= status < 600:
        return status
    return None


def transient(error: BaseException) -> bool:
    """Whether a read that raised ``error`` may succeed if tried again: a connection reset or a
    timeout, or a response whose HTTP status says so (:data:`TRANSIENT_STATUSES`: 429 Too Many
    Requests as 503 Slow Down), found on the error or one of its causes (s3fs raises an
    ``OSError`` caused by botocore's error)."""
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
        if http_status(current) in TRANSIENT_STATUSES:
            return True
        current = current.__cause__ or current.__context__
    return False


def named(error: Exception, what: str, url: str) -> Exception:
    """``error`` as raised to the user: the same type where it can carry the URL, with it."""
    if isinstance(error, FileNotFoundError):
        return FileNotFoundError(errno.ENOENT, f"{url} does not exist ({what})")
    if isinstance(error, PermissionError):
        return PermissionError(
            errno.EACCES, f"access to {url} was denied ({what}: {error}); check the credentials"
        )
    status = next((found for found in map(http_status, _chain(error)) if found is not None), None)
    said = f" (HTTP {status})" if status is not None else ""
    return OSError(f"{url}: {what} failed{said}: {type(error).__name__}: {error}")


def _chain(error: BaseException) -> list[BaseException]:
    """``error`` and its causes, in order."""
    found: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and all(current is not seen for seen in found):
        found.append(current)
        current = current.__cause__ or current.__context__
    return found


def storage_failure(url: str, error: BaseException) -> StorageFailure:
    """A :class:`StorageFailure` for ``url`` that says what ``error`` says once, readably."""
    text = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
    return StorageFailure(text if url in text else f"cannot read {url}: {text}")
