"""Request bodies larger than `--max-body-size` get a 413 in the error envelope, before they are read.

A Content-Length over the limit is refused at once; a chunked body is counted as it arrives and refused at the
first chunk that crosses the limit. The refusal closes the connection, so the rest of the body is never read.
"""

from __future__ import annotations

from .errors import APIError


class BodyTooLarge(Exception):
    pass


def too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"The request body is larger than this server's limit of {_size(limit)} (mlxcel serve --max-body-size).",
    )


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} bytes"


async def send_error(send, error: APIError) -> None:
    """An error envelope as the whole response, closing the connection after it."""
    body = error.response().body
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class BodyLimit:
    """ASGI middleware: at most `limit` body bytes per request."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.strip().isdigit() and int(length) > self.limit:
            await send_error(send, too_large(self.limit))
            return
        seen = 0
        started = False

        async def counted_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise BodyTooLarge
            return message

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except BodyTooLarge:
            if not started:
                await send_error(send, too_large(self.limit))
