"""An S3-protocol server for measurements, and a proxy in front of it that counts what it serves.

* :class:`S3Server`: moto's server (a real S3 protocol over HTTP) on 127.0.0.1, in a thread of
  this process (``threaded=True``: tests) or in a process of its own (the bench, so that serving
  does not share this process's interpreter lock).
* :class:`CountingProxy`: an HTTP/1.1 reverse proxy on 127.0.0.1 that forwards every request to
  the server and records (method, path, status, bytes of the response body). Clients point their
  ``endpoint_url`` at the proxy; nothing else changes (moto does not check signatures unless told
  to). What a loader costs before its first batch is then a count, not a timing.
"""

from __future__ import annotations

import http.client
import http.server
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_HOP = {"connection", "keep-alive", "transfer-encoding", "expect", "content-length"}


@dataclass(frozen=True)
class Served:
    method: str
    path: str  # the request's path, without its query
    status: int
    bytes: int  # of the response's body
    query: str = ""
    range: str = ""  # the request's Range header

    @property
    def name(self) -> str:
        """The object's name (the path's last part)."""
        return self.path.rstrip("/").rsplit("/", 1)[-1]


class CountingProxy:
    """Forwards HTTP to ``upstream`` (``http://host:port``) and counts what it serves."""

    def __init__(self, upstream: str) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        self._upstream = (parsed.hostname or "127.0.0.1", parsed.port or 80)
        self._lock = threading.Lock()
        self.served: list[Served] = []
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # (a response goes out as its headers, then its body: with Nagle's algorithm on, the
            # body waited for the client's delayed ACK of the headers, ~40 ms a request on
            # some requests, and the proxy slowed every client behind it)
            disable_nagle_algorithm = True

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                proxy._forward(self)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward

        self._server = _Server(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._local = threading.local()

    def _connection(self) -> http.client.HTTPConnection:
        connection: http.client.HTTPConnection | None = getattr(self._local, "connection", None)
        if connection is None:
            connection = http.client.HTTPConnection(*self._upstream, timeout=120)
            self._local.connection = connection
        return connection

    def _forward(self, handler: http.server.BaseHTTPRequestHandler) -> None:
        body = _request_body(handler)
        headers = {k: v for k, v in handler.headers.items() if k.lower() not in _HOP}
        headers["Content-Length"] = str(len(body))
        for attempt in range(2):
            connection = self._connection()
            try:
                connection.request(handler.command, handler.path, body=body, headers=headers)
                response = connection.getresponse()
                data = response.read()
                break
            except (http.client.HTTPException, OSError):
                connection.close()
                self._local.connection = None
                if attempt:
                    raise
        handler.send_response_only(response.status, response.reason)
        for key, value in response.getheaders():
            if key.lower() not in _HOP:
                handler.send_header(key, value)
        length = response.getheader("Content-Length") if handler.command == "HEAD" else None
        handler.send_header("Content-Length", length or str(len(data)))
        handler.end_headers()
        sent = 0
        if handler.command != "HEAD":
            handler.wfile.write(data)
            sent = len(data)
        path, _, query = handler.path.partition("?")
        served = Served(
            handler.command,
            urllib.parse.unquote(path),
            response.status,
            sent,
            query,
            handler.headers.get("Range", ""),
        )
        with self._lock:
            self.served.append(served)

    def count(self) -> tuple[int, int]:
        """(requests, bytes) served so far."""
        with self._lock:
            return len(self.served), sum(s.bytes for s in self.served)

    def reset(self) -> None:
        with self._lock:
            self.served.clear()

    def records(self) -> list[Served]:
        with self._lock:
            return list(self.served)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)


class _Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            super().handle_error(request, client_address)  # (a client that went away: fine)


def _request_body(handler: http.server.BaseHTTPRequestHandler) -> bytes:
    length = handler.headers.get("Content-Length")
    if length is not None:
        return handler.rfile.read(int(length))
    if handler.headers.get("Transfer-Encoding", "").lower() == "chunked":
        parts = []
        while True:
            size = int(handler.rfile.readline().split(b";")[0].strip(), 16)
            if size == 0:
                while handler.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                return b"".join(parts)
            parts.append(handler.rfile.read(size))
            handler.rfile.readline()
    return b""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class S3Server:
    """moto's S3 server on 127.0.0.1 (a thread here, or a process of its own)."""

    KEY = "testing"

    def __init__(self, *, threaded: bool = True) -> None:
        self._process: subprocess.Popen[bytes] | None = None
        self._threaded: Any = None
        if threaded:
            from moto.server import ThreadedMotoServer

            self._threaded = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            self._threaded.start()
            host, port = self._threaded.get_host_and_port()
            self.endpoint = f"http://{host}:{port}"
        else:
            port = free_port()
            self._process = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            self.endpoint = f"http://127.0.0.1:{port}"

    def client(self, endpoint: str | None = None) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=endpoint or self.endpoint,
            aws_access_key_id=self.KEY,
            aws_secret_access_key=self.KEY,
            region_name="us-east-1",
        )

    def options(self, endpoint: str | None = None) -> dict[str, Any]:
        """``storage_options`` for s3fs, through ``endpoint`` (a proxy) or straight."""
        return {
            "key": self.KEY,
            "secret": self.KEY,
            "endpoint_url": endpoint or self.endpoint,
            "client_kwargs": {"region_name": "us-east-1"},
        }

    def bucket(self, name: str, files: list[Path] | None = None) -> None:
        """Create bucket ``name`` (waiting for a server process to listen) with ``files``."""
        client = self.client()
        try:
            for attempt in range(200):
                try:
                    client.create_bucket(Bucket=name)
                    break
                except Exception:
                    if attempt == 199 or self._process is None:
                        raise
                    time.sleep(0.05)  # (the server process is not listening yet)
            for path in files or []:
                client.upload_file(str(path), name, path.name)
        finally:
            client.close()

    def close(self) -> None:
        if self._threaded is not None:
            self._threaded.stop()
            server = getattr(self._threaded, "_server", None)
            if server is not None:  # (stop() leaves the listening socket open)
                server.server_close()
        if self._process is not None:
            self._process.kill()
            self._process.wait()
