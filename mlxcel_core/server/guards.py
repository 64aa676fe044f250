"""The ASGI middleware around the routes, outermost first:

1. ShutdownGuard (shutdown.py): once the shutdown grace runs out, a running request's reply ends with an error;
2. BrowserPolicy (browsers.py): the Host and Origin checks, CORS;
3. BodyLimit (body_limit.py): bodies over --max-body-size get a 413.

Each answers in the OpenAI error envelope (errors.py).
"""

from __future__ import annotations

from starlette.middleware import Middleware

from .body_limit import BodyLimit
from .browsers import BrowserPolicy
from .shutdown import Drain, ShutdownGuard


def middleware(config, drain: Drain) -> list[Middleware]:
    """`config`: the app's ServerConfig."""
    return [
        Middleware(ShutdownGuard, drain=drain),
        Middleware(BrowserPolicy, http=config.http, api_key=config.api_key),
        Middleware(BodyLimit, limit=config.http.max_body_bytes),
    ]
