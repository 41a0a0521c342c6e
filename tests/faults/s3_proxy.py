"""A fault-injecting HTTP proxy in front of the moto S3 server (tests/engine/conftest.py).

The code under test talks to it as to S3 (its `endpoint_url`), through botocore with its
retries, multipart uploads and connection pool, so a fault is what a real object store does:
an answer 500 InternalError, 503 ServiceUnavailable or 503 SlowDown, or the connection reset
(TCP RST) after half of a request's body. A fault hits the uploads (PUT: PutObject, UploadPart)
whose key contains `match`, every one of them from the first until the client deletes what it
had uploaded there (the checkpointer cleaning up a failed save before its retry): an outage that
lasts exactly one try of the save, whatever botocore's own retries do inside it. Everything else
goes through unchanged.
"""

from __future__ import annotations

import http.client
import socket
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

ERRORS = {
    "s3_500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "s3_503": (503, "ServiceUnavailable", "Service is unable to handle request."),
    "s3_slowdown": (503, "SlowDown", "Please reduce your request rate."),
}


class FaultProxy:
    def __init__(self, upstream: str, fault: str | None, match: str) -> None:
        """`fault` None: a plain proxy (a clean run's timings through the same hop)."""
        if fault not in (*ERRORS, "s3_reset", None):
            raise ValueError(f"unknown S3 fault {fault!r}")
        self.upstream = urlsplit(upstream)
        self.fault, self.match = fault, match
        self.struck = 0
        self.healed = False
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _body(self) -> bytes:
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _handle(self) -> None:
                if self.command == "PUT" and proxy.match in self.path and proxy._take():
                    if proxy.fault == "s3_reset":
                        self.rfile.read(int(self.headers.get("Content-Length") or 0) // 2)
                        # RST instead of FIN: the client sees "connection reset by peer" mid-upload.
                        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        self.close_connection = True
                        self.connection.close()
                        return
                    self._body()
                    status, code, message = ERRORS[proxy.fault]
                    body = (
                        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                        f"<Message>{message}</Message></Error>"
                    ).encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                body = self._body()
                if self.command in ("DELETE", "POST") and proxy.struck and (
                    proxy.match in self.path or proxy.match.encode() in body
                ):
                    proxy.healed = True  # the failed try's files are being deleted: the outage ends
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "expect")}
                    conn.request(self.command, self.path, body=body or None, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    self.send_response(resp.status, resp.reason)
                    head = self.command == "HEAD"  # its Content-Length is the object's: kept
                    for k, v in resp.getheaders():
                        dropped = ("transfer-encoding", "connection", "server", "date") + (() if head else ("content-length",))
                        if k.lower() not in dropped:
                            self.send_header(k, v)
                    if not head:
                        self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _take(self) -> bool:
        with self._lock:
            if self.healed or self.fault is None:
                return False
            self.struck += 1
            return True

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
