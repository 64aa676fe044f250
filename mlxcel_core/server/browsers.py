"""Web browsers: which pages may use the server (Origin, CORS) and which host names it answers to (Host).

Without `--api-key` anyone who can reach the port can use the server, so a web page must not be able to:
- a request with an `Origin` header (a browser's, from a web page) is refused with 403 unless the origin is
  localhost (http or https, any port: `localhost`, `*.localhost`, `127.x.x.x`, `[::1]`) or matches
  `--allowed-origins` (exact origins, `*` inside one as a wildcard, or `*` alone for every origin), as Ollama's
  OLLAMA_ORIGINS;
- on a loopback address, a request whose `Host` is not localhost, an IP address or this machine's name is refused
  with 403: a page that rebinds its own DNS name to 127.0.0.1 (DNS rebinding) is same-origin for its browser, so
  only the Host header tells it apart.
With `--api-key` neither check applies (a page cannot send the key it does not have). In both cases an allowed
origin gets CORS headers, and its preflight (OPTIONS with Access-Control-Request-Method) a 204.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from functools import lru_cache

from starlette.datastructures import Headers

from .body_limit import send_error
from .errors import APIError
from .http_config import HttpConfig

_LOCAL_ORIGIN = re.compile(r"https?://(localhost|[^/:]+\.localhost|127(\.\d{1,3}){3}|\[::1\])(:\d{1,5})?")
_METHODS = b"GET, POST, OPTIONS"
_MAX_AGE = b"600"


@lru_cache(maxsize=1)
def _machine_name() -> str:
    return socket.gethostname().lower().rstrip(".")


def host_allowed(host: str) -> bool:
    """A Host header naming localhost, an IP address or this machine (with or without a port)."""
    host = host.strip().lower()
    if host.startswith("["):  # [v6]:port
        name = host[1 : host.find("]")] if "]" in host else host
    else:
        name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    name = name.rstrip(".")
    if not name or name == "localhost" or name.endswith(".localhost") or name == _machine_name():
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


@lru_cache(maxsize=64)
def _pattern(entry: str) -> re.Pattern:
    return re.compile("[^/]*".join(re.escape(part) for part in entry.lower().split("*")))


def origin_allowed(origin: str, allowed: tuple[str, ...]) -> bool:
    origin = origin.strip().lower().rstrip("/")
    if _LOCAL_ORIGIN.fullmatch(origin):
        return True
    return any(entry == "*" or _pattern(entry).fullmatch(origin) for entry in allowed)


def _forbidden_host(host: str) -> APIError:
    return APIError(
        403,
        f"Host {host!r} is not allowed: on a loopback address this server answers requests for localhost only "
        "(a defence against DNS rebinding). Use http://localhost:PORT, or start mlxcel serve with --api-key.",
    )


def _forbidden_origin(origin: str) -> APIError:
    return APIError(
        403,
        f"Origin {origin!r} is not allowed to use this server. Start mlxcel serve with "
        f"--allowed-origins {origin} to allow that web page (or --api-key).",
    )


class BrowserPolicy:
    """ASGI middleware: the Host and Origin checks and CORS headers described in the module docstring."""

    def __init__(self, app, http: HttpConfig, api_key: str | None):
        self.app, self.http, self.open = app, http, not api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        host = headers.get("host")
        if self.open and self.http.loopback and host is not None and not host_allowed(host):
            await self._refuse(receive, send, _forbidden_host(host))
            return
        origin = headers.get("origin")
        if origin is None:
            await self.app(scope, receive, send)
            return
        preflight = scope["method"] == "OPTIONS" and "access-control-request-method" in headers
        if not origin_allowed(origin, self.http.allowed_origins):
            if self.open or preflight:
                await self._refuse(receive, send, _forbidden_origin(origin))
            else:  # the key protects the routes; without CORS headers the page cannot read a reply
                await self.app(scope, receive, send)
            return
        cors = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]
        if preflight:
            await self._preflight(headers, cors, send)
            return

        async def send_with_cors(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *cors]}
            await send(message)

        await self.app(scope, receive, send_with_cors)

    async def _refuse(self, receive, send, error: APIError) -> None:
        """The 403, after reading the request body (up to --max-body-size): closing the connection with the
        body still arriving makes the kernel reset it, and the client may lose the 403 it was sent."""
        seen = 0
        while seen <= self.http.max_body_bytes:
            message = await receive()
            if message["type"] != "http.request":
                break
            seen += len(message.get("body", b""))
            if not message.get("more_body", False):
                break
        await send_error(send, error)

    @staticmethod
    async def _preflight(headers: Headers, cors: list, send) -> None:
        allow = [
            *cors,
            (b"access-control-allow-methods", _METHODS),
            (b"access-control-allow-headers", headers.get("access-control-request-headers", "").encode("latin-1")),
            (b"access-control-max-age", _MAX_AGE),
        ]
        if headers.get("access-control-request-private-network") == "true":  # Chrome's Private Network Access
            allow.append((b"access-control-allow-private-network", b"true"))
        await send({"type": "http.response.start", "status": 204, "headers": allow})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
