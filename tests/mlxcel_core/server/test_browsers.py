"""Web pages and the server (server/browsers.py), through the real app under uvicorn: without an API key a
foreign Origin and, on loopback, a foreign Host get 403 in the envelope; localhost and --allowed-origins get CORS
headers and preflights; with a key neither check applies."""

from __future__ import annotations

import socket

import pytest

from mlxcel_core.server.browsers import host_allowed, origin_allowed
from mlxcel_core.server.http_config import HttpConfig, parse_origins

COMPLETION = {"prompt": "Hi", "max_tokens": 1}


def forbidden(response, what: str) -> dict:
    assert response.status_code == 403, response.text
    error = response.json()["error"]
    assert error["code"] == 403 and error["type"] == "permission_error" and what in error["message"]
    assert "access-control-allow-origin" not in response.headers
    return error


def preflight(http, origin: str, path: str = "/v1/chat/completions"):
    headers = {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type, authorization",
    }
    return http.options(path, headers=headers)


def test_open_server_refuses_foreign_hosts_and_origins(server):
    with server.client() as http:
        # DNS rebinding: the page's own name, resolved to 127.0.0.1
        error = forbidden(http.get("/v1/models", headers={"Host": "attacker.example:8080"}), "attacker.example")
        assert "--api-key" in error["message"]
        forbidden(http.post("/v1/completions", json=COMPLETION, headers={"Host": "evil.test"}), "evil.test")
        for host in ("localhost:8080", "127.0.0.1", "[::1]:1234", "app.localhost", "LOCALHOST."):
            assert http.get("/health", headers={"Host": host}).status_code == 200, host
        # a page on another site
        error = forbidden(
            http.post("/v1/completions", json=COMPLETION, headers={"Origin": "https://evil.example"}), "evil.example"
        )
        assert "--allowed-origins https://evil.example" in error["message"]
        forbidden(preflight(http, "https://evil.example"), "evil.example")
        forbidden(http.get("/health", headers={"Origin": "null"}), "null")  # file:// pages, sandboxed frames


def test_localhost_pages_get_cors(server):
    with server.client() as http:
        for origin in ("http://localhost:5173", "https://127.0.0.1", "http://[::1]:3000", "http://ui.localhost:80"):
            response = http.post("/v1/completions", json=COMPLETION, headers={"Origin": origin})
            assert response.status_code == 200, response.text
            assert response.headers["access-control-allow-origin"] == origin
            assert "origin" in response.headers["vary"].lower()
        answer = preflight(http, "http://localhost:5173")
        assert answer.status_code == 204
        assert answer.headers["access-control-allow-origin"] == "http://localhost:5173"
        assert "POST" in answer.headers["access-control-allow-methods"]
        assert answer.headers["access-control-allow-headers"] == "content-type, authorization"
        with http.stream(
            "POST", "/v1/completions", json={**COMPLETION, "stream": True}, headers={"Origin": "http://localhost:3000"}
        ) as stream:  # streamed replies carry the header too
            assert stream.headers["access-control-allow-origin"] == "http://localhost:3000"
            assert list(stream.iter_lines())[-2] == "data: [DONE]"


def test_allowed_origins(make_server):
    allowed = parse_origins("https://app.example.com, https://*.corp.example/,")
    assert allowed == ("https://app.example.com", "https://*.corp.example")
    server = make_server(warmup=False, http=HttpConfig(allowed_origins=allowed))
    with server.client() as http:
        for origin in ("https://app.example.com", "https://chat.corp.example"):
            response = http.post("/v1/completions", json=COMPLETION, headers={"Origin": origin})
            assert response.status_code == 200 and response.headers["access-control-allow-origin"] == origin
            assert preflight(http, origin).status_code == 204
        for origin in ("http://app.example.com", "https://app.example.com.evil.test", "https://corp.example"):
            forbidden(http.post("/v1/completions", json=COMPLETION, headers={"Origin": origin}), origin)


def test_any_origin_and_other_addresses(make_server):
    server = make_server(warmup=False, http=HttpConfig(allowed_origins=("*",), bind_host="0.0.0.0"))
    with server.client() as http:
        response = http.post("/v1/completions", json=COMPLETION, headers={"Origin": "https://anything.example"})
        assert response.headers["access-control-allow-origin"] == "https://anything.example"
        # not bound to loopback: a LAN name in Host is how clients reach it
        assert http.get("/health", headers={"Host": "gpu-box.lan:8080"}).status_code == 200


def test_with_an_api_key_the_key_decides(make_server):
    server = make_server(warmup=False, api_key="k")
    key = {"Authorization": "Bearer k"}
    with server.client() as http:
        assert http.get("/v1/models", headers={**key, "Host": "my-proxy.example"}).status_code == 200
        response = http.post("/v1/completions", json=COMPLETION, headers={**key, "Origin": "https://evil.example"})
        assert response.status_code == 200 and "access-control-allow-origin" not in response.headers
        assert (
            http.post("/v1/completions", json=COMPLETION, headers={"Origin": "https://evil.example"}).status_code == 401
        )
        forbidden(preflight(http, "https://evil.example"), "evil.example")
        assert preflight(http, "http://localhost:8000").status_code == 204  # (preflights carry no key)


@pytest.mark.parametrize(
    "host,ok",
    [("localhost", True), ("10.0.0.7:80", True), ("[fe80::1]", True), ("localhost.evil.test", False), ("", True)],
)
def test_host_names(host, ok):
    assert host_allowed(host) is ok


def test_origin_patterns():
    assert origin_allowed("HTTP://LOCALHOST:8080", ())
    assert not origin_allowed("http://localhost.evil.test", ())
    assert not origin_allowed("https://a.b/c.corp.example", ("https://*.corp.example",))
    assert origin_allowed("chrome-extension://abcdef", ("chrome-extension://*",))


def test_refusal_reaches_a_client_still_sending_its_body(server):
    """The 403 waits for the body: closing with body bytes unread makes the kernel reset the connection under a
    client still sending, and the client may lose the 403 it was sent."""
    host, port = server.url.removeprefix("http://").split(":")
    body = b" " * (4 << 20)  # more than uvicorn buffers before it stops reading
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nOrigin: https://evil.example\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head + body)  # a ConnectionResetError here is the failure
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 403"), reply[:200]
    assert b"evil.example" in reply
