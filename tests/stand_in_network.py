"""Local stand-ins for the network a first run meets: an endpoint that resets every connection, one that accepts and
never answers, and a package index (PEP 691 JSON or PEP 503 HTML simple pages) serving one wheel.

A plain module (like servers.py): `from stand_in_network import ...`. Every stand-in runs on a daemon thread and
is closed by its context manager.
"""

from __future__ import annotations

import hashlib
import io
import json
import socket
import struct
import threading
import zipfile
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace


def _listener() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock


@contextmanager
def resetting_endpoint():
    """http://127.0.0.1:PORT where every connection is reset (RST) once the request has arrived."""
    sock = _listener()

    def serve():
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            try:
                conn.recv(65536)
            except OSError:
                pass
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


@contextmanager
def silent_endpoint():
    """http://127.0.0.1:PORT that accepts every connection and never sends a byte."""
    sock = _listener()
    held: list[socket.socket] = []

    def serve():
        while True:
            try:
                held.append(sock.accept()[0])
            except OSError:
                return

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()
        for conn in held:
            conn.close()


def make_wheel(members: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return out.getvalue()


@contextmanager
def package_index(project: str, filename: str, wheel: bytes, *, style: str = "json", sha256: str | None = "right"):
    """A simple-API index at http://127.0.0.1:PORT/simple/ listing `filename` for `project`.
    style: "json" (PEP 691) or "html" (PEP 503). sha256: "right", "wrong" or None (no hash listed).
    `.requests` records each request's (path, Accept header, Authorization header)."""
    digest = {"right": hashlib.sha256(wheel).hexdigest(), "wrong": "0" * 64, None: None}[sha256]
    requests: list[tuple[str, str, str]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            requests.append((self.path, self.headers.get("Accept", ""), self.headers.get("Authorization", "")))
            if self.path.rstrip("/") == f"/simple/{project}":
                if style == "json":
                    entry = {"filename": filename, "url": f"/files/{filename}", "hashes": {}}
                    if digest:
                        entry["hashes"]["sha256"] = digest
                    body = json.dumps({"meta": {"api-version": "1.0"}, "name": project, "files": [entry]}).encode()
                    kind = "application/vnd.pypi.simple.v1+json"
                else:
                    href = f"../../files/{filename}" + (f"#sha256={digest}" if digest else "")
                    body = f'<html><body><a href="{href}">{filename}</a><br/></body></html>'.encode()
                    kind = "text/html"
                return self._send(200, kind, body)
            if self.path == f"/files/{filename}":
                return self._send(200, "application/octet-stream", wheel)
            self._send(404, "text/plain", b"not found")

        def _send(self, code, kind, body):
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield SimpleNamespace(url=f"http://127.0.0.1:{server.server_address[1]}/simple/", requests=requests)
    finally:
        server.shutdown()
        server.server_close()
