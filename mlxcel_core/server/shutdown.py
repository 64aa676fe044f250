"""Graceful shutdown: running requests get `--shutdown-grace` seconds to finish, then each ends with an error.

When the server stops accepting connections (Ctrl-C, SIGTERM), `Drain.begin` starts the grace period. Requests
that finish within it are untouched. When it runs out, every request still running is cancelled and
`ShutdownGuard` ends its reply: a response not yet started becomes a 503 in the error envelope; a server-sent
event stream gets an error event in the envelope, then `data: [DONE]`. The connections then close and the engine
thread stops (the app's lifespan).
"""

from __future__ import annotations

import asyncio

from .body_limit import send_error
from .errors import APIError
from .replies import DONE


class Drain:
    """The requests in flight, and the clock that ends them once shutdown has started."""

    def __init__(self, grace: float):
        self.grace = grace
        self.tasks: set[asyncio.Task] = set()
        self.started = False
        self.expired = False

    def begin(self) -> None:
        """Shutdown started (called on the event loop): cancel what is still running after the grace."""
        if not self.started:
            self.started = True
            asyncio.get_running_loop().call_later(max(self.grace, 0.0), self._expire)

    def _expire(self) -> None:
        self.expired = True
        for task in list(self.tasks):
            task.cancel()

    def error(self) -> APIError:
        return APIError(
            503,
            f"The server is shutting down: the request did not finish within the {self.grace:g} s grace period "
            "(mlxcel serve --shutdown-grace).",
        )


class _Reply:
    """What a request has sent so far."""

    def __init__(self):
        self.started = self.finished = self.event_stream = False

    def saw(self, message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            content_type = dict(message.get("headers") or []).get(b"content-type", b"")
            self.event_stream = content_type.startswith(b"text/event-stream")
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.finished = True


class ShutdownGuard:
    """ASGI middleware: tracks each HTTP request's task and ends its reply properly when the grace runs out."""

    def __init__(self, app, drain: Drain):
        self.app, self.drain = app, drain

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        task = asyncio.current_task()
        reply = _Reply()

        async def tracked_send(message):
            await send(message)
            reply.saw(message)

        self.drain.tasks.add(task)
        try:
            await self.app(scope, receive, tracked_send)
        except asyncio.CancelledError:
            if not self.drain.expired:
                raise
            await self._end(reply, send)
        finally:
            self.drain.tasks.discard(task)

    async def _end(self, reply: _Reply, send) -> None:
        error = self.drain.error()
        if not reply.started:
            await send_error(send, error)
        elif not reply.finished:
            body = error.sse() + DONE if reply.event_stream else b""
            await send({"type": "http.response.body", "body": body, "more_body": False})
