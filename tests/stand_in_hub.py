"""A local stand-in for the Hugging Face Hub: the few routes huggingface_hub's downloads use, over real HTTP.

    with stand_in_hub({"org/model": {"config.json": b"{}", "model.safetensors": data}}) as hub:
        env["HF_ENDPOINT"] = hub.url   # huggingface_hub reads it when imported: a subprocess, or pass endpoint=

Routes: repo info (`/api/models/REPO/revision/REV`), the recursive tree listing with git blob ids and LFS sha256
(`/api/models/REPO/tree/REV`), and file downloads (`/REPO/resolve/REV/FILE`, HEAD and GET, with Range). Every
file larger than 64 bytes is an "LFS" file (its ETag and tree entry carry its sha256, as on the Hub).
`hub.requests` records (method, path, Range header) of each request. `hub.cut_once[FILE] = N` makes the first GET
of FILE stop after N bytes (the connection closes mid-body; huggingface_hub reads 10 MiB chunks, so only whole
chunks before the cut are kept and resumed from); `hub.serve_instead[FILE] = bytes` serves other bytes than the
listing describes (a corrupt transfer).
"""

from __future__ import annotations

import hashlib
import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

LFS_MIN = 64


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class _Hub:
    def __init__(self, repos: dict[str, dict[str, bytes]]):
        self.repos = repos
        self.commits = {repo: hashlib.sha1(repo.encode()).hexdigest() for repo in repos}
        self.requests: list[tuple[str, str, str | None]] = []
        self.cut_once: dict[str, int] = {}
        self.serve_instead: dict[str, bytes] = {}
        self.url = ""

    def tree(self, repo: str) -> list[dict]:
        entries = []
        for path, data in sorted(self.repos[repo].items()):
            entry = {"type": "file", "path": path, "size": len(data), "oid": git_blob_id(data)}
            if len(data) > LFS_MIN:
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 130}
            entries.append(entry)
        return entries

    def etag(self, data: bytes) -> str:
        return hashlib.sha256(data).hexdigest() if len(data) > LFS_MIN else git_blob_id(data)


def _handler(hub: _Hub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def _json(self, payload, status: int = 200) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _not_found(self, kind: str = "RepoNotFound") -> None:
            body = json.dumps({"error": "not found"}).encode()
            self.send_response(404)
            self.send_header("X-Error-Code", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _route(self):
            path = unquote(urlparse(self.path).path)
            hub.requests.append((self.command, path, self.headers.get("Range")))
            for repo in hub.repos:
                if path.startswith(f"/api/models/{repo}/revision/"):
                    return ("info", repo, None)
                if path.startswith(f"/api/models/{repo}/tree/"):
                    return ("tree", repo, None)
                prefix = f"/{repo}/resolve/"
                if path.startswith(prefix):
                    return ("file", repo, path[len(prefix) :].split("/", 1)[1])
            return (None, None, None)

        def do_GET(self):
            kind, repo, name = self._route()
            if kind is None:
                return self._not_found()
            if kind == "info":
                siblings = [{"rfilename": p} for p in sorted(hub.repos[repo])]
                return self._json({"id": repo, "sha": hub.commits[repo], "siblings": siblings, "private": False})
            if kind == "tree":
                return self._json(hub.tree(repo))
            self._file(repo, name, body=True)

        def do_HEAD(self):
            kind, repo, name = self._route()
            if kind != "file":
                return self._not_found()
            self._file(repo, name, body=False)

        def _file(self, repo: str, name: str, body: bool) -> None:
            if name not in hub.repos[repo]:
                return self._not_found("EntryNotFound")
            data = hub.repos[repo][name]
            sent = hub.serve_instead.get(name, data)
            start = 0
            if body and self.headers.get("Range", "").startswith("bytes="):
                start = int(self.headers["Range"][len("bytes=") :].split("-")[0])
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", hub.commits[repo])
            self.send_header("ETag", f'"{hub.etag(data)}"')
            self.send_header("Content-Length", str(len(sent) - start))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(sent) - 1}/{len(sent)}")
            self.end_headers()
            if not body:
                return
            if name in hub.cut_once:
                self.wfile.write(sent[: hub.cut_once.pop(name)])
                self.wfile.flush()
                self.close_connection = True
                return
            self.wfile.write(sent[start:])

    return Handler


@contextmanager
def stand_in_hub(repos: dict[str, dict[str, bytes]]):
    hub = _Hub(repos)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    server.daemon_threads = True
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
