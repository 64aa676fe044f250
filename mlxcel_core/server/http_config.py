"""The HTTP layer's settings: body size, header and body deadlines, connection cap, shutdown grace, browser policy.

`mlxcel serve` fills one from its flags (--max-body-size, --header-timeout, --body-timeout, --max-connections,
--shutdown-grace, --allowed-origins); `ServerConfig.http` carries it to the app (body_limit.py, browsers.py,
shutdown.py) and to uvicorn (connections.py).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

MIB = 1024 * 1024
# 16 MiB: a whole context of the largest common windows (1M tokens is ~4 MB of text, ~7 MB as JSON token ids) with
# room to spare, while a body near the limit is still parsed in well under a second.
DEFAULT_MAX_BODY_BYTES = 16 * MIB
_SIZE = re.compile(r"\s*(\d+)\s*([kmg]i?b?|b)?\s*", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1024, "m": MIB, "g": 1024 * MIB}


@dataclass
class HttpConfig:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies: 413
    header_timeout: float = 10.0  # seconds from a connection's (or a request's) first byte to its last header
    body_timeout: float = 60.0  # seconds from the last header to the end of the body
    max_connections: int = 1024  # open connections; one more is answered 503 and closed
    shutdown_grace: float = 5.0  # seconds running requests may take to finish once shutdown starts
    allowed_origins: tuple[str, ...] = ()  # browser origins allowed besides localhost ("*": every origin)
    bind_host: str = "127.0.0.1"  # the address listened on: loopback turns on the Host header check

    @property
    def loopback(self) -> bool:
        host = self.bind_host.strip("[]")
        if host == "localhost":
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False


def parse_size(text: str) -> int:
    """'16M', '512k', '1GiB', '1048576' -> bytes (binary units); ValueError otherwise."""
    match = _SIZE.fullmatch(text)
    if not match:
        raise ValueError(f"not a size: {text!r} (use bytes or a K, M or G suffix, e.g. 16M)")
    number, unit = match.groups()
    return int(number) * _UNITS[(unit or "").lower()[:1]]


def parse_origins(text: str | None) -> tuple[str, ...]:
    """A comma list of origins ('https://app.example.com,http://*.lan:3000', '*') -> a tuple, blanks dropped."""
    return tuple(part.strip().rstrip("/") for part in (text or "").split(",") if part.strip())
