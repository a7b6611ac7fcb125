"""Stores on 127.0.0.1 that answer as remote ones do, for the tests of what the loader does with
their answers:

* :class:`ThrottlingProxy`: the counting proxy in front of an S3 server (``bench._s3``) that
  answers the next N requests for an object with HTTP 429 Too Many Requests and an S3 error body,
  as a store does that limits its request rate, and forwards the others.
* :class:`LocalHub`: the few routes of the Hugging Face Hub's HTTP API that ``huggingface_hub``'s
  ``HfFileSystem`` (``hf://``) uses to list and read a dataset repository: a revision's
  information, a tree listing, and a file's bytes (ranged) from ``resolve``. The answers have the
  Hub's shapes (JSON entries with ``oid``, ``size`` and ``lfs``; 404s with ``X-Error-Code``);
  it records every request with its ``Authorization`` header, and can answer 429 as the proxy
  does.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
import urllib.parse
from dataclasses import dataclass
from typing import Any

from bench._s3 import CountingProxy, Served

#: An S3-style error body for HTTP 429 (the code some S3-compatible stores answer a request
#: rate over their limit with).
THROTTLED_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>TooManyRequests</Code>'
    b"<Message>Too many requests: slow down</Message><RequestId>0</RequestId></Error>"
)


#: S3's own answer to a request rate over its limit: 503 SlowDown.
SLOW_DOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message><RequestId>0</RequestId></Error>"
)
_ANSWERS = {
    429: ("Too Many Requests", THROTTLED_BODY),
    503: ("Slow Down", SLOW_DOWN_BODY),
}


class ThrottlingProxy(CountingProxy):
    """A :class:`CountingProxy` that answers the next ``times`` GETs of an object named
    ``name`` with 429 (or S3's 503 SlowDown: :meth:`throttle`), recorded among ``served`` with
    that status."""

    def __init__(self, upstream: str) -> None:
        self._throttled: dict[str, int] = {}
        self._status = 429
        super().__init__(upstream)

    def throttle(self, name: str, times: int, status: int = 429) -> None:
        """Answer the next ``times`` GETs of the object ``name`` (its key's last part) with
        ``status``: 429, or 503 (SlowDown)."""
        with self._lock:
            self._throttled[name] = times
            self._status = status

    def throttled(self) -> list[Served]:
        """The requests answered 429 or 503."""
        return [s for s in self.records() if s.status in _ANSWERS]

    def _forward(self, handler: http.server.BaseHTTPRequestHandler) -> None:
        path, _, query = handler.path.partition("?")
        name = urllib.parse.unquote(path).rstrip("/").rsplit("/", 1)[-1]
        with self._lock:
            refuse = handler.command == "GET" and self._throttled.get(name, 0) > 0
            if refuse:
                self._throttled[name] -= 1
        if not refuse:
            super()._forward(handler)
            return
        length = handler.headers.get("Content-Length")
        if length:
            handler.rfile.read(int(length))
        status = self._status
        reason, body = _ANSWERS[status]
        handler.send_response_only(status, reason)
        handler.send_header("Content-Type", "application/xml")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)
        served = Served(
            "GET", urllib.parse.unquote(path), status, 0, query, handler.headers.get("Range", "")
        )
        with self._lock:
            self.served.append(served)


@dataclass(frozen=True)
class HubRequest:
    method: str
    path: str  # unquoted, without the query
    query: str
    range: str
    authorization: str
    status: int


class LocalHub:
    """The Hub's routes that ``HfFileSystem`` lists and reads dataset repositories with (see the
    module docstring). ``add(repo, revision, files)`` puts a revision's files (path in the repo
    -> bytes); ``endpoint`` is what ``HF_ENDPOINT`` or ``storage_options={"endpoint": ...}``
    name."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._repos: dict[str, dict[str, dict[str, bytes]]] = {}
        self._throttled: dict[str, int] = {}
        self.requests: list[HubRequest] = []
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # (as the counting proxy: bench._s3)

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                hub._answer(self)

            do_HEAD = do_GET

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"

    def add(self, repo: str, revision: str, files: dict[str, bytes]) -> None:
        with self._lock:
            self._repos.setdefault(repo, {})[revision] = dict(files)

    def throttle(self, route: str, times: int) -> None:
        """Answer the next ``times`` requests whose path holds ``route`` with 429."""
        with self._lock:
            self._throttled[route] = times

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    # -- the routes ------------------------------------------------------------------------------

    def _answer(self, handler: http.server.BaseHTTPRequestHandler) -> None:
        raw, _, query = handler.path.partition("?")
        parts = raw.strip("/").split("/")
        status, headers, body = self._route(handler, parts, query)
        handler.send_response_only(status)
        for key, value in headers.items():
            handler.send_header(key, value)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(body)
        with self._lock:
            self.requests.append(
                HubRequest(
                    handler.command,
                    urllib.parse.unquote(raw),
                    query,
                    handler.headers.get("Range", ""),
                    handler.headers.get("Authorization", ""),
                    status,
                )
            )

    def _route(
        self, handler: http.server.BaseHTTPRequestHandler, parts: list[str], query: str
    ) -> tuple[int, dict[str, str], bytes]:
        with self._lock:
            for route, left in self._throttled.items():
                if left > 0 and route in urllib.parse.unquote(handler.path):
                    self._throttled[route] = left - 1
                    return _json(429, {"error": "Too Many Requests"}, {"Retry-After": "0"})
        # /api/datasets/<ns>/<name>/revision/<rev>, /api/datasets/<ns>/<name>/tree/<rev>[/<path>]
        if len(parts) >= 6 and parts[:2] == ["api", "datasets"]:
            repo, route = f"{parts[2]}/{parts[3]}", parts[4]
            revision = urllib.parse.unquote(parts[5])
            inside = urllib.parse.unquote("/".join(parts[6:]))
            files = self._revision(repo, revision)
            if isinstance(files, tuple):
                return files
            if route == "revision":
                return _json(200, {"id": repo, "sha": _sha(revision), "private": False})
            if route == "tree":
                recursive = "recursive=true" in query.lower() or "recursive=1" in query
                return self._tree(files, inside, recursive)
        # /datasets/<ns>/<name>/resolve/<rev>/<path>
        if len(parts) >= 6 and parts[0] == "datasets" and parts[3] == "resolve":
            repo, revision = f"{parts[1]}/{parts[2]}", urllib.parse.unquote(parts[4])
            files = self._revision(repo, revision)
            if isinstance(files, tuple):
                return files
            data = files.get(urllib.parse.unquote("/".join(parts[5:])))
            if data is None:
                return _json(404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"})
            return _ranged(data, handler.headers.get("Range", ""))
        return _json(404, {"error": "not a route of this hub"})

    def _revision(
        self, repo: str, revision: str
    ) -> dict[str, bytes] | tuple[int, dict[str, str], bytes]:
        with self._lock:
            revisions = self._repos.get(repo)
            if revisions is None:
                return _json(
                    404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"}
                )
            files = revisions.get(revision)
        if files is None:
            return _json(404, {"error": "Invalid rev id"}, {"X-Error-Code": "RevisionNotFound"})
        return files

    @staticmethod
    def _tree(
        files: dict[str, bytes], inside: str, recursive: bool
    ) -> tuple[int, dict[str, str], bytes]:
        prefix = f"{inside}/" if inside else ""
        entries: dict[str, dict[str, Any]] = {}
        for path in sorted(files):
            if not path.startswith(prefix):
                continue
            parts = path[len(prefix) :].split("/")
            for depth in range(1, len(parts)):  # (the folders on the way)
                if depth > 1 and not recursive:
                    break
                folder = prefix + "/".join(parts[:depth])
                entries.setdefault(
                    folder, {"type": "directory", "oid": _sha(folder), "size": 0, "path": folder}
                )
            if len(parts) == 1 or recursive:
                data = files[path]
                entries[path] = {
                    "type": "file",
                    "oid": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest(),
                    "size": len(data),
                    "path": path,
                    "lfs": {
                        "oid": hashlib.sha256(data).hexdigest(),
                        "size": len(data),
                        "pointerSize": 134,
                    },
                }
        if not entries:
            return _json(404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"})
        return _json(200, list(entries.values()))


def _sha(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


def _json(
    status: int, value: Any, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    return (
        status,
        {"Content-Type": "application/json", **(headers or {})},
        json.dumps(value).encode(),
    )


def _ranged(data: bytes, wanted: str) -> tuple[int, dict[str, str], bytes]:
    headers = {"Content-Type": "application/octet-stream", "Accept-Ranges": "bytes"}
    if not wanted.startswith("bytes="):
        return 200, headers, data
    first, _, last = wanted[len("bytes=") :].partition("-")
    if not first:  # (the last N bytes)
        start, end = max(0, len(data) - int(last)), len(data)
    else:
        start, end = int(first), min(len(data), int(last) + 1 if last else len(data))
    if start >= len(data):
        return 416, {"Content-Range": f"bytes */{len(data)}"}, b""
    headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
    return 206, headers, data[start:end]
