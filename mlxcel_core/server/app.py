"""The OpenAI-compatible HTTP app (Starlette). Routes only translate: JSON -> validated request ->
engine jobs (engine_loop.py) -> OpenAI-shaped JSON or server-sent events. No MLX here.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics,
POST /tokenize, POST /detokenize. With an API key every route but /health needs `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..constraints import Constraint, ConstraintError, check
from ..engine import EngineConfig
from ..processors import DEFAULT_DRY_SEQUENCE_BREAKERS
from ..sampling import SamplingParams
from .engine_loop import EngineLoop, Event, Job, log
from .errors import APIError, bad_request, context_exceeded, from_core_error, from_validation_error
from .metrics import ServerMetrics
from .replies import Reply, TokenFormatter
from .schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .tool_calls import plan_tools

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context


@dataclass
class ServerConfig:
    model: str | None = None  # what -m said; None: the default model
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(max_batch_size=4))
    api_key: str | None = None
    max_queue_depth: int = 32  # sequences that may wait for a batch slot; beyond: 503
    max_n: int = 4
    ctx_size: int | None = None  # cap on the model's context
    group: Any = None  # rank 0 of a tensor-parallel group (mx.distributed), else None
    warmup: bool = True  # short requests on a throwaway engine before /health turns 200 (server/warmup.py)


class Server:
    """Per-app state: the engine thread, metrics, and what the routes need to know about the model."""

    def __init__(self, config: ServerConfig, load=None, on_load_failed=None):
        from ..loading import DEFAULT_MODEL_NAME

        self.config = config
        self.metrics = ServerMetrics()
        if load is None:
            from ..loading import load_model

            def load():
                return load_model(config.model, log=lambda m: log.info("%s", m), group=config.group)

        capacity = config.engine.max_batch_size + config.max_queue_depth
        self.engine = EngineLoop(
            load,
            config.engine,
            self.metrics,
            config.ctx_size,
            capacity,
            on_load_failed=on_load_failed,
            group=config.group,
            warmup=config.warmup,
        )
        self.model_id = config.model or DEFAULT_MODEL_NAME
        self.created = int(time.time())
        self._formatter = None

    def aliases(self) -> set[str]:
        """Model names a request may use: the id (the -m value), its basename, and the loaded file's."""
        names = {self.model_id, Path(self.model_id).name}
        if self.engine.loaded is not None:
            path = self.engine.loaded.source.path
            names |= {str(path), path.name, path.stem}
        names |= {n[: -len(".gguf")] for n in names if n.endswith(".gguf")}
        if self.config.model is None:
            from ..loading.resolve import DEFAULT_HUB_REPO

            names.add(DEFAULT_HUB_REPO)
        return {n for n in names if n}

    def authorize(self, request: Request) -> None:
        key = self.config.api_key
        if not key:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.")

    def ready(self, request: Request):
        """Authorize, then the loaded model (503 while loading or when the engine is down)."""
        self.authorize(request)
        reason = self.engine.health()
        if reason is not None:
            raise APIError(503, reason)
        return self.engine.loaded

    def check_model(self, name: str | None) -> None:
        if name and name not in self.aliases():
            raise APIError(404, f"The model `{name}` does not exist.", "model")

    @property
    def formatter(self) -> "TokenFormatter":
        if self._formatter is None:
            self._formatter = TokenFormatter(self.engine.loaded.tokenizer)
        return self._formatter

    @property
    def vocab_size(self) -> int:
        loaded = self.engine.loaded
        return min(loaded.tokenizer.vocab_size, loaded.config.get("vocab_size") or loaded.tokenizer.vocab_size)


# -- request parsing --------------------------------------------------------------------------------
async def parse(request: Request, schema):
    raw = await request.body()
    try:
        return schema.model_validate_json(raw)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def validate_logit_bias(bias: dict | None, vocab_size: int) -> dict | None:
    for key, value in (bias or {}).items():
        if not key.strip().lstrip("-").isdigit() or not 0 <= int(key) < vocab_size:
            raise bad_request(f"logit_bias key {key!r} is not a token id in [0, {vocab_size}).", "logit_bias")
        if not -100 <= value <= 100:
            raise bad_request(f"logit_bias value for token {key} must be in [-100, 100].", "logit_bias")
    return bias


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> list[int]:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"Token id {bad} is outside the vocabulary [0, {vocab_size}).", param)
    return ids


def response_constraint(response_format) -> Constraint | None:
    """The request's response_format as a Constraint, compiled once here so a bad schema is a 400 naming it."""
    if response_format is None or response_format.type == "text":
        return None
    try:
        if response_format.type == "json_object":
            constraint = Constraint.json_object()
        elif response_format.json_schema is None:
            raise bad_request("response_format of type json_schema needs a 'json_schema' object.", "response_format")
        else:
            schema = response_format.json_schema.schema_
            constraint = Constraint.json_schema(True if schema is None else schema)
        check(constraint)
    except ConstraintError as exc:
        raise bad_request(f"Invalid response_format: {exc}.", "response_format") from None
    return constraint


def sampling_params(
    body,
    *,
    seed: int | None,
    max_tokens: int,
    logprobs: int | None,
    prompt_len: int,
    constraint: Constraint | None = None,
) -> SamplingParams:
    """A request's SamplingParams (built on the engine thread: a request's logits processors may hold MLX arrays).

    `prompt_len` is unused by the built-in stages (the engine knows the prompt) but lets tests wrap this.
    """
    breakers = body.dry_sequence_breakers
    return SamplingParams(
        temperature=body.temperature,
        top_k=max(body.top_k, 0),
        top_p=body.top_p,
        min_p=body.min_p,
        seed=seed,
        max_tokens=max_tokens,
        stop=tuple(body.stop),
        logprobs=logprobs,
        logit_bias=body.logit_bias or None,
        suppress_tokens=tuple(body.suppress_tokens or ()),
        repetition_penalty=body.penalty(),
        repeat_last_n=body.repeat_last_n,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        dry_multiplier=body.dry_multiplier,
        dry_base=body.dry_base,
        dry_allowed_length=body.dry_allowed_length,
        dry_penalty_last_n=body.dry_penalty_last_n,
        dry_sequence_breakers=DEFAULT_DRY_SEQUENCE_BREAKERS if breakers is None else tuple(breakers),
        xtc_threshold=body.xtc_threshold,
        xtc_probability=body.xtc_probability,
        constraint=constraint,
    )


# -- routes -----------------------------------------------------------------------------------------
async def completions(request: Request) -> Response:
    server: Server = request.app.state.server
    loaded = server.ready(request)
    body = await parse(request, CompletionRequest)
    server.check_model(body.model)
    if body.echo:
        raise bad_request("echo is not supported.", "echo")
    prompt = body.single_prompt()
    if isinstance(prompt, str):
        ids = loaded.tokenizer.encode(prompt)
    else:
        ids = check_token_ids(prompt, server.vocab_size, "prompt")
    return await generate(
        request,
        server,
        body,
        ids,
        chat=False,
        limit=body.max_tokens,
        limit_param="max_tokens",
        prompt_param="prompt",
        logprobs=body.logprobs,
    )


async def chat_completions(request: Request) -> Response:
    server: Server = request.app.state.server
    loaded = server.ready(request)
    body = await parse(request, ChatCompletionRequest)
    server.check_model(body.model)
    messages = body.template_messages()
    if not loaded.tokenizer.chat_template:
        raise bad_request("This model has no chat template: use /v1/completions with a raw prompt.", "messages")
    family, tools, constraint = plan_tools(body, loaded.tokenizer.chat_template)
    try:
        ids = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **tools)
    except Exception as exc:  # noqa: BLE001 - a template rejecting the conversation is the client's input
        raise bad_request(f"The chat template rejected the messages: {exc}", "messages") from None
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return await generate(
        request,
        server,
        body,
        ids,
        chat=True,
        limit=body.completion_limit,
        limit_param=body.limit_param,
        prompt_param="messages",
        logprobs=logprobs,
        constraint=constraint,
        tool_family=family,
    )


async def generate(
    request: Request,
    server: Server,
    body,
    prompt_ids: list[int],
    *,
    chat: bool,
    limit: int | None,
    limit_param: str,
    prompt_param: str,
    logprobs: int | None,
    constraint: Constraint | None = None,
    tool_family: str | None = None,
) -> Response:
    """`constraint`: the tool-call grammar (else response_format's); `tool_family`: parse tool calls so."""
    ctx, n_prompt = server.engine.max_context, len(prompt_ids)
    if n_prompt >= ctx:
        raise context_exceeded(
            f"The prompt has {n_prompt} tokens but the context holds {ctx} "
            f"(prompt and completion together). Please shorten the prompt.",
            prompt_param,
            n_prompt,
            ctx,
        )
    room = ctx - n_prompt
    if limit is None:
        max_tokens = room if chat else min(COMPLETIONS_DEFAULT_MAX_TOKENS, room)
    elif limit > room:
        raise context_exceeded(
            f"This model's maximum context length is {ctx} tokens. However, you requested "
            f"{n_prompt + limit} tokens ({n_prompt} in the prompt, {limit} for the completion). "
            f"Please reduce the prompt or {limit_param}.",
            limit_param,
            n_prompt,
            ctx,
        )
    else:
        max_tokens = limit
    if body.n > server.config.max_n:
        raise bad_request(f"n must be at most {server.config.max_n} on this server (--max-n), got {body.n}.", "n")
    validate_logit_bias(body.logit_bias, server.vocab_size)
    check_token_ids(body.suppress_tokens or [], server.vocab_size, "suppress_tokens")
    body.penalty()  # both spellings of the repeat penalty agree
    constraint = constraint or response_constraint(body.response_format)

    def make_params(index: int):
        seed = body.seed + index if body.seed is not None else None  # n choices must differ
        return lambda: sampling_params(
            body, seed=seed, max_tokens=max_tokens, logprobs=logprobs, prompt_len=n_prompt, constraint=constraint
        )

    loop, events = asyncio.get_running_loop(), asyncio.Queue()

    def emit(event: Event) -> None:  # from the engine thread
        try:
            loop.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: the server is going away
            pass

    jobs = [Job(prompt_ids, make_params(i), i, emit) for i in range(body.n)]
    server.engine.submit(jobs)
    try:
        await wait_opened(events, len(jobs))
    except BaseException:
        server.engine.cancel(jobs)
        raise
    model = body.model or server.model_id
    reply = Reply(server, chat, model, logprobs is not None, body.include_usage, len(jobs), tool_family)
    if body.stream:
        return EventStream(reply.stream(events), on_close=lambda: server.engine.cancel(jobs))
    try:
        result = await until_disconnect(request, reply.collect(events))
    finally:
        server.engine.cancel(jobs)  # a no-op for finished sequences
    return JSONResponse(result)


async def wait_opened(events: asyncio.Queue, n: int) -> None:
    """Every job is in the engine, or the first refusal as an APIError (the others are cancelled by the caller)."""
    opened = 0
    while opened < n:
        event = await events.get()
        if event.kind == "error":
            exc = event.error
            raise exc if isinstance(exc, APIError) else from_core_error(exc)
        opened += 1


async def until_disconnect(request: Request, work):
    """Run `work` unless the client goes away first (then it is cancelled and 499-style nothing is sent)."""
    task = asyncio.ensure_future(work)

    async def watch():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled():
        raise APIError(400, "The client disconnected.")
    return task.result()


class EventStream(Response):
    """Server-sent events; the client going away cancels the generator at once (not at its next write)."""

    media_type = "text/event-stream"

    def __init__(self, events, on_close):
        self.events, self.on_close = events, on_close
        self.status_code, self.background = 200, None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream():
                    try:
                        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
                        async for chunk in self.events:
                            await send({"type": "http.response.body", "body": chunk, "more_body": True})
                        await send({"type": "http.response.body", "body": b"", "more_body": False})
                    except OSError:  # the client is gone
                        pass
                    group.cancel_scope.cancel()

                async def watch():
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                group.start_soon(watch)
        finally:
            await self.events.aclose()
            self.on_close()


async def models(request: Request) -> Response:
    server: Server = request.app.state.server
    server.authorize(request)
    meta = {"n_ctx": server.engine.max_context} if server.engine.ready else {}
    return JSONResponse(
        {
            "object": "list",
            "data": [
                {
                    "id": server.model_id,
                    "object": "model",
                    "created": server.created,
                    "owned_by": "mlxcel",
                    "meta": meta,
                }
            ],
        }
    )


async def health(request: Request) -> Response:
    reason = request.app.state.server.engine.health()
    return APIError(503, reason).response() if reason else JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    server: Server = request.app.state.server
    server.authorize(request)
    return Response(server.metrics.render(), media_type=server.metrics.content_type)


async def tokenize(request: Request) -> Response:
    server: Server = request.app.state.server
    loaded = server.ready(request)
    body = await parse(request, TokenizeRequest)
    return JSONResponse({"tokens": loaded.tokenizer.encode(body.content, add_special_tokens=body.add_special)})


async def detokenize(request: Request) -> Response:
    server: Server = request.app.state.server
    loaded = server.ready(request)
    body = await parse(request, DetokenizeRequest)
    ids = check_token_ids(body.tokens, loaded.tokenizer.vocab_size, "tokens")
    return JSONResponse({"content": loaded.tokenizer.decode(ids)})


# -- errors -----------------------------------------------------------------------------------------
async def api_error(request: Request, exc: APIError) -> Response:
    return exc.response()


async def http_error(request: Request, exc: HTTPException) -> Response:
    message = "Not found." if exc.status_code == 404 else str(exc.detail)
    return APIError(exc.status_code, message).response()


async def server_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error in %s %s", request.method, request.url.path)
    return from_core_error(exc).response()


def create_app(config: ServerConfig, load=None, on_load_failed=None) -> Starlette:
    """The ASGI app. The engine thread starts (and loads the model) when the app starts serving."""
    server = Server(config, load, on_load_failed)

    @asynccontextmanager
    async def lifespan(app):
        server.engine.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, server.engine.stop)

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={APIError: api_error, HTTPException: http_error, Exception: server_error},
    )
    app.state.server = server
    return app
