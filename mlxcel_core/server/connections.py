"""HTTP connections under uvicorn: deadlines, a connection cap, the error envelope for requests the app never sees,
and the start of graceful shutdown.

uvicorn's h11 protocol times out idle kept-alive connections only: a client that sends part of its headers, or part
of a body (a Content-Length larger than what it sends, an unfinished chunked body), holds its connection forever,
and enough of them exhaust the process's file descriptors (slowloris). `GuardedProtocol` adds, per connection:

- a header deadline: `header_timeout` seconds from the connection's start (or from the first byte of a later
  request on a kept-alive connection) to the end of the headers; then a 408 in the error envelope when some bytes
  came (a connection that sent nothing is closed silently, as browsers open spare ones), and the connection closes;
- a body deadline: `body_timeout` seconds from the end of the headers to the end of the body; then a 408 in the
  envelope unless the reply has started, and the connection closes (the app sees the client disconnect);
- a cap: while `max_connections` connections are open, a new one is answered 503 in the envelope and closed;
- a request that is not HTTP (a garbage request line, malformed headers) gets a 400 in the envelope, not uvicorn's
  plain-text one.

`MlxcelServer` starts the app's Drain (shutdown.py) when uvicorn begins its shutdown; uvicorn's own graceful
timeout is set past the Drain's grace and only backs it up.
"""

from __future__ import annotations

import asyncio
import http
import json
import logging

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import APIError
from .http_config import HttpConfig

log = logging.getLogger("mlxcel.server")
SHUTDOWN_BACKSTOP_S = 5.0  # uvicorn cancels what is left this long after the Drain's grace
KEEP_ALIVE_S = 30  # an idle kept-alive connection is closed after this


def raw_response(error: APIError) -> bytes:
    """A whole HTTP/1.1 response carrying the error envelope, closing the connection."""
    body = json.dumps(error.body(), ensure_ascii=False).encode()
    head = (
        f"HTTP/1.1 {error.status} {http.HTTPStatus(error.status).phrase}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class GuardedProtocol(H11Protocol):
    """uvicorn's h11 protocol with the deadlines, cap and envelope described in the module docstring."""

    http_config: HttpConfig  # set on the per-server subclass (protocol_class)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._deadline_kind: str | None = None
        self._refused = False

    # -- asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        limit = self.http_config.max_connections
        if len(self.server_state.connections) >= limit:
            self._refused = True
            log.warning("refused a connection: %d connections are open (--max-connections)", limit)
            message = f"The server has too many open connections (limit {limit}, --max-connections). Retry later."
            transport.write(raw_response(APIError(503, message)))
            transport.close()
            return
        super().connection_made(transport)
        self._watch()

    def connection_lost(self, exc) -> None:
        self._set_deadline(None)
        if not self._refused:
            super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        super().data_received(data)
        self._watch()

    # -- uvicorn hooks ---------------------------------------------------------------------------
    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def send_400_response(self, msg: str) -> None:
        self._set_deadline(None)
        message = "The request is not valid HTTP/1.1 (malformed request line or headers)."
        self.transport.write(raw_response(APIError(400, message)))
        self.transport.close()

    # -- deadlines -------------------------------------------------------------------------------
    def _watch(self) -> None:
        """Arm the deadline the connection's state calls for: headers being read, a body being read, or none."""
        if self.transport is None or self.transport.is_closing():
            want = None
        elif self.conn.their_state is h11.SEND_BODY:
            want = "body"
        elif self.conn.their_state is h11.IDLE and (self.cycle is None or self.conn.trailing_data[0]):
            want = "headers"  # a new connection, or the first bytes of a later request
        else:
            want = None
        if want != self._deadline_kind:
            self._set_deadline(want)

    def _set_deadline(self, kind: str | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._deadline_kind = None, kind
        if kind is not None:
            timeout = self.http_config.header_timeout if kind == "headers" else self.http_config.body_timeout
            self._deadline = self.loop.call_later(timeout, self._expired, kind, timeout)

    def _expired(self, kind: str, timeout: float) -> None:
        self._deadline = self._deadline_kind = None
        if self.transport.is_closing():
            return
        client = "%s:%d" % self.client if self.client else "a client"
        log.warning("closed the connection of %s: its %s did not arrive within %g s", client, kind, timeout)
        option = "--header-timeout" if kind == "headers" else "--body-timeout"
        error = APIError(408, f"The request's {kind} did not arrive within {timeout:g} s ({option}).")
        cycle = self.cycle if kind == "body" else None
        if kind == "headers" and self.conn.trailing_data[0]:
            self.transport.write(raw_response(error))
        elif cycle is not None and not cycle.response_started:
            cycle.response_started = True  # (the app's own reply, if it comes, is dropped)
            self.transport.write(raw_response(error))
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app's receive() returns http.disconnect
            cycle.message_event.set()
        self.transport.close()


def protocol_class(config: HttpConfig) -> type[GuardedProtocol]:
    return type("MlxcelH11Protocol", (GuardedProtocol,), {"http_config": config})


class MlxcelServer(uvicorn.Server):
    """uvicorn's server, starting the app's Drain (shutdown.py) when it begins shutting down."""

    def __init__(self, config: uvicorn.Config, drain):
        super().__init__(config)
        self.drain = drain

    async def shutdown(self, sockets=None) -> None:
        self.drain.begin()
        await super().shutdown(sockets)


def uvicorn_server(app) -> MlxcelServer:
    """The uvicorn server for an app from create_app, configured from its ServerConfig.http."""
    config: HttpConfig = app.state.server.config.http
    return MlxcelServer(
        uvicorn.Config(
            app,
            http=protocol_class(config),
            log_config=None,
            lifespan="on",
            timeout_graceful_shutdown=config.shutdown_grace + SHUTDOWN_BACKSTOP_S,
            timeout_keep_alive=KEEP_ALIVE_S,
        ),
        app.state.drain,
    )


def fit_to_fd_limit(wanted: int, spare: int = 128) -> int:
    """`wanted` connections, raising this process's open-file limit to fit them and `spare` more files (the
    model's, the listening socket, ...) where the hard limit allows; else as many as the limit leaves room for."""
    try:
        import resource
    except ImportError:  # (not on Windows)
        return wanted
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = wanted + spare
    if soft == resource.RLIM_INFINITY or soft >= need:
        return wanted
    target = need if hard == resource.RLIM_INFINITY else min(need, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    except (ValueError, OSError):
        pass
    return wanted if soft >= need else max(1, soft - spare)
