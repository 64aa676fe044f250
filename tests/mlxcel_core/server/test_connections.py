"""Hostile connections against the real app under uvicorn (server/connections.py, body_limit.py, offload.py), with
raw sockets: unfinished headers and bodies are cut at their deadlines with a 408, /health stays fast meanwhile,
the connection cap answers 503, a garbage request line gets the envelope, bodies over the limit get 413, and
tokenizing a huge prompt does not freeze the event loop."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from servers import TIMEOUT

from mlxcel_core.server.http_config import HttpConfig


def connect(server) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def read_until_closed(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """Everything the server sends until it closes the connection (AssertionError if it does not in time)."""
    sock.settimeout(timeout)
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except socket.timeout:
        raise AssertionError(f"the server kept the connection open for {timeout} s") from None
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def envelope(data: bytes, status: int) -> dict:
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode()), data[:200]
    assert b"content-type: application/json" in head.lower()
    error = json.loads(body)["error"]
    assert error["code"] == status and error["message"] and set(error) >= {"type", "param"}
    return error


def health_seconds(server) -> float:
    start = time.monotonic()
    assert httpx.get(f"{server.url}/health", timeout=TIMEOUT).status_code == 200
    return time.monotonic() - start


def open_connections(server) -> int:
    return len(server.uvicorn_server.server_state.connections)


def test_unfinished_headers_are_cut_at_the_deadline_while_health_stays_fast(make_server):
    server = make_server(warmup=False, http=HttpConfig(header_timeout=3.0, shutdown_grace=1.0))
    stalled = [connect(server) for _ in range(200)]
    for sock in stalled:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty")
    silent = connect(server)  # sends nothing at all
    server.wait_for(lambda: open_connections(server) >= 201, 5, "the connections to be accepted")
    assert health_seconds(server) < 1.0
    assert open_connections(server) >= 201  # (all still open: /health answered beside them)
    for sock in stalled:
        error = envelope(read_until_closed(sock), 408)
        assert "headers" in error["message"] and "--header-timeout" in error["message"]
        sock.close()
    assert read_until_closed(silent) == b""  # nothing sent, nothing answered (browsers open spare connections)
    silent.close()
    assert health_seconds(server) < 1.0


def test_a_kept_alive_connection_gets_the_header_deadline_for_its_next_request(make_server):
    server = make_server(warmup=False, http=HttpConfig(header_timeout=1.5, shutdown_grace=1.0))
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        first = b""
        while not first.endswith(b'{"status":"ok"}'):
            first += sock.recv(4096)
        assert first.startswith(b"HTTP/1.1 200 ")
        time.sleep(2.0)  # idle between requests: kept alive (its own 30 s limit), no header deadline
        sock.sendall(b"GET /health HTTP/1.1\r\nHo")
        start = time.monotonic()
        envelope(read_until_closed(sock), 408)
        assert 1.3 < time.monotonic() - start < 8


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n" + b'{"content": "',
        b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n" + b'8\r\n{"conten\r\n',
    ],
    ids=["short-content-length", "unfinished-chunked"],
)
def test_unfinished_bodies_are_cut_at_the_deadline(make_server, request_bytes):
    server = make_server(warmup=False, http=HttpConfig(body_timeout=1.5, shutdown_grace=1.0))
    with connect(server) as sock:
        start = time.monotonic()
        sock.sendall(request_bytes)
        error = envelope(read_until_closed(sock), 408)
        assert 1.4 < time.monotonic() - start < 8
        assert "body" in error["message"] and "--body-timeout" in error["message"]
    with server.client() as http:  # the app saw a client that went away; the server goes on
        assert http.post("/tokenize", json={"content": "hi"}).status_code == 200
    assert open_connections(server) <= 1


def test_a_connection_over_the_cap_gets_503_and_the_others_go_on(make_server):
    server = make_server(warmup=False, http=HttpConfig(max_connections=4, shutdown_grace=1.0))
    idle = [connect(server) for _ in range(4)]
    server.wait_for(lambda: open_connections(server) == 4, 5, "four connections")
    with connect(server) as extra:
        error = envelope(read_until_closed(extra), 503)
        assert "--max-connections" in error["message"]
    idle.pop().close()
    server.wait_for(lambda: open_connections(server) == 3, 5, "a slot to free up")
    with server.client() as http:
        assert http.get("/health").status_code == 200
    for sock in idle:
        sock.close()


@pytest.mark.parametrize(
    "request_bytes",
    [b"GARBAGE\r\n\r\n", b"GET /health HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n", b"\x16\x03\x01\x00\xa5\x01"],
    ids=["request-line", "header-line", "tls-hello"],
)
def test_a_request_that_is_not_http_gets_the_envelope(server, request_bytes):
    with connect(server) as sock:
        sock.sendall(request_bytes + (b"\r\n\r\n" if request_bytes.startswith(b"\x16") else b""))
        error = envelope(read_until_closed(sock), 400)
    assert error["type"] == "invalid_request_error" and "HTTP" in error["message"]


def test_bodies_over_the_limit_get_413_before_they_are_read(make_server):
    server = make_server(warmup=False, http=HttpConfig(max_body_bytes=1024, shutdown_grace=1.0))
    with connect(server) as sock:  # the headers announce too much: answered without waiting for the body
        sock.sendall(b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5000\r\n\r\n")
        error = envelope(read_until_closed(sock, 5), 413)
    assert "1 KiB" in error["message"] and "--max-body-size" in error["message"]
    with server.client() as http:
        chunks = iter([b'{"content": "', b"x" * 2000, b'"}'])  # chunked: counted as it arrives
        response = http.post("/tokenize", content=chunks)
        assert response.status_code == 413 and response.json()["error"]["code"] == 413
        assert http.post("/tokenize", json={"content": "x" * 900}).status_code == 200


@pytest.mark.parametrize("path", ["/tokenize", "/v1/completions"])
def test_health_answers_while_a_huge_prompt_is_tokenized(server, path):
    content = "The capital of France is Paris. " * 80_000  # 2.6 MB: seconds of tokenizing for the tiny tokenizer
    body = {"content": content} if path == "/tokenize" else {"prompt": content, "max_tokens": 1}
    done: dict = {}

    def tokenize():
        with server.client(timeout=120) as http:
            done["reply"] = http.post(path, json=body).json()
        done["at"] = time.monotonic()

    worker = threading.Thread(target=tokenize)
    worker.start()
    time.sleep(0.5)  # (the body is in; tokenizing has begun)
    latencies, probed_at = [], []
    while "at" not in done and len(latencies) < 10:
        latencies.append(health_seconds(server))
        probed_at.append(time.monotonic())
        time.sleep(0.1)
    worker.join(120)
    if path == "/tokenize":
        assert len(done["reply"]["tokens"]) > 100_000
    else:  # (counted, then refused: far more than the context)
        assert done["reply"]["error"]["n_prompt_tokens"] > 100_000
    during = sorted(lat for lat, at in zip(latencies, probed_at) if at < done["at"])
    # A frozen event loop answers nothing until the tokenizer is done: one probe at most, taking seconds.
    assert len(during) >= 3, during
    assert during[len(during) // 2] < 1.0, during
