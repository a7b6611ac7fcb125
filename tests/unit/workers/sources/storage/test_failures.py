"""Failed requests to a store (``workers.sources.storage._failures``): which errors are tried
again, which mean the store cannot be reached, and how the others reach the user."""

from __future__ import annotations

import errno
import socket

import pytest

from workers.sources.storage import IdentityChanged, StorageFailure, storage_failure
from workers.sources.storage._failures import http_status, named, transient, unreachable


class EndpointConnectionError(Exception):
    """(botocore's name for a store it could not connect to)"""


def test_errors_that_say_no_connection_could_be_made_are_unreachable() -> None:
    assert unreachable(ConnectionRefusedError())
    assert unreachable(socket.gaierror(-2, "Name or service not known"))
    assert unreachable(EndpointConnectionError("http://127.0.0.1:1"))
    wrapped = OSError("wrapped")
    wrapped.__cause__ = EndpointConnectionError("x")
    assert unreachable(wrapped)  # (found among the causes)
    assert not unreachable(ConnectionResetError())
    assert not unreachable(TimeoutError())


def test_a_reset_or_a_timeout_is_transient_a_missing_object_is_not() -> None:
    assert transient(OSError(errno.ECONNRESET, "reset"))
    assert transient(OSError(errno.ETIMEDOUT, "timed out"))
    assert not transient(OSError(errno.ENOSPC, "full"))
    assert not transient(IsADirectoryError())
    cause = RuntimeError("outer")
    cause.__context__ = type("ReadTimeoutError", (Exception,), {})()
    assert transient(cause)
    looped = RuntimeError("loop")
    looped.__cause__ = looped  # (a cycle of causes ends)
    assert not transient(looped)


def test_an_error_reaches_the_user_with_its_url_and_its_type_where_it_can() -> None:
    missing = named(FileNotFoundError("gone"), "reading bytes 0-9", "s3://b/x.tar")
    assert isinstance(missing, FileNotFoundError) and missing.errno == errno.ENOENT
    assert "s3://b/x.tar does not exist (reading bytes 0-9)" in str(missing)
    denied = named(PermissionError("no"), "listing", "s3://b/")
    assert isinstance(denied, PermissionError) and "check the credentials" in str(denied)
    other = named(ValueError("odd"), "listing", "s3://b/")
    assert type(other) is OSError and str(other) == "s3://b/: listing failed: ValueError: odd"


def test_a_storage_failure_names_its_url_once() -> None:
    said = storage_failure("s3://b/x.tar", OSError(errno.EIO, "s3://b/x.tar: broken"))
    assert str(said) == "s3://b/x.tar: broken"
    plain = storage_failure("s3://b/x.tar", EOFError("short read"))
    assert str(plain) == "cannot read s3://b/x.tar: short read"
    assert isinstance(plain, OSError) and plain._loader_fatal  # (the worker stops on it)


def test_a_changed_object_is_a_storage_failure_that_says_what_was_found() -> None:
    error = IdentityChanged("s3://b/x.tar", (10, "etag:a"), (12, "etag:b"))
    assert isinstance(error, StorageFailure)
    assert error.found == (12, "etag:b") and error.expected == (10, "etag:a")
    with pytest.raises(StorageFailure, match="is not the object expected"):
        raise error


def test_a_429_or_a_503_is_transient_by_its_status_a_404_or_a_403_is_not() -> None:
    """Botocore's error as s3fs raises it (an ``OSError`` caused by it), huggingface_hub's."""
    botocore = pytest.importorskip("botocore.exceptions")

    def s3(status: int, code: str) -> OSError:
        cause = botocore.ClientError(
            {
                "Error": {"Code": code, "Message": "m"},
                "ResponseMetadata": {"HTTPStatusCode": status},
            },
            "GetObject",
        )
        raised = OSError(errno.EIO, str(cause))
        raised.__cause__ = cause
        return raised

    assert transient(s3(429, "TooManyRequests"))
    assert transient(s3(503, "SlowDown"))
    assert transient(s3(500, "InternalError"))
    assert not transient(s3(404, "NoSuchKey"))
    assert not transient(s3(403, "AccessDenied"))
    assert not transient(s3(400, "InvalidRange"))
    assert http_status(s3(429, "TooManyRequests").__cause__) == 429  # type: ignore[arg-type]

    hub = pytest.importorskip("huggingface_hub.errors")
    httpx = pytest.importorskip("httpx2")

    def from_hub(status: int) -> Exception:
        request = httpx.Request("GET", "https://huggingface.co/api/datasets/a/b/revision/main")
        return hub.HfHubHTTPError("m", response=httpx.Response(status, request=request))

    assert transient(from_hub(429)) and transient(from_hub(502))
    assert not transient(from_hub(404)) and not transient(from_hub(401))
    assert http_status(ValueError("no response")) is None
