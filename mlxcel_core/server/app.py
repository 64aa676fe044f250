"""The OpenAI-compatible HTTP app (Starlette). Routes only translate: JSON -> validated request ->
engine jobs (engine_loop.py) -> OpenAI-shaped JSON or server-sent events. No MLX here.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics,
POST /tokenize, POST /detokenize, GET /openapi.json (openapi.py). With an API key every route but /health needs
`Authorization: Bearer KEY`.
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
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .. import __version__
from ..constraints import Constraint, compiled_now
from ..engine import EngineConfig
from ..processors import DEFAULT_DRY_SEQUENCE_BREAKERS
from .engine_loop import EngineLoop, Event, Job, log
from .errors import APIError, bad_request, context_exceeded, from_core_error, from_validation_error
from .guards import middleware
from .http_config import HttpConfig
from .metrics import ServerMetrics
from .offload import Offload
from .openapi import openapi_document
from .replies import Reply, TokenFormatter
from .reply_text import TextPlan, plan_text
from .request_params import check_token_ids, checked, response_constraint, sampling_params, validate_logit_bias
from .schemas import SEED_LIMIT, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .shutdown import Drain
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
    http: HttpConfig = field(default_factory=HttpConfig)  # body size, deadlines, browsers, shutdown grace
    parse_special_in_content: bool = False  # chat: special-token text in content -> control tokens (chat_tokens.py)
    adapter_path: str | None = None  # an mlx-lm LoRA/DoRA adapter directory, fused at load (adapters.py)


class Server:
    """Per-app state: the engine thread, metrics, and what the routes need to know about the model."""

    def __init__(self, config: ServerConfig, load=None, on_load_failed=None):
        from ..loading import DEFAULT_MODEL_NAME

        self.config = config
        self.metrics = ServerMetrics()
        self.offload = Offload()  # parsing, templates, tokenizing: off the event loop (offload.py)
        if load is None:
            from ..loading import load_model

            def load():
                from .warmup import modules_early

                return load_model(
                    config.model,
                    log=lambda m: log.info("%s", m),
                    group=config.group,
                    adapter_path=config.adapter_path,
                    on_source=modules_early if config.warmup else None,
                )

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
    try:
        raw = await request.body()
    except ClientDisconnect:  # (the body deadline, connections.py, answers it)
        raise APIError(400, "The client disconnected before the whole body arrived.") from None
    try:
        return await request.app.state.server.offload.run(schema.model_validate_json, raw)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


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
        ids = await server.offload.run(loaded.tokenizer.encode, prompt)
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
    # (a forced call's grammar is compiled to check it: off the event loop, as every grammar is)
    family, tools, constraint = await server.offload.run(plan_tools, body, loaded.tokenizer.chat_template)
    try:
        ids = await server.offload.run(
            loaded.tokenizer.apply_chat_template,
            messages,
            add_generation_prompt=True,
            parse_special_in_content=server.config.parse_special_in_content,
            **tools,
        )
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
        text_plan=plan_text(body, loaded.tokenizer, ids, family, constraint),
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
    text_plan: TextPlan | None = None,
) -> Response:
    """`constraint`: the tool-call grammar (else response_format's); `text_plan`: server/reply_text.py's."""
    n_prompt = len(prompt_ids)
    max_tokens = completion_budget(server.engine.max_context, n_prompt, chat, limit, limit_param, prompt_param)
    if body.n > server.config.max_n:
        raise bad_request(f"n must be at most {server.config.max_n} on this server (--max-n), got {body.n}.", "n")
    validate_logit_bias(body.logit_bias, server.vocab_size)
    check_token_ids(body.suppress_tokens or [], server.vocab_size, "suppress_tokens")
    body.penalty()  # both spellings of the repeat penalty agree
    param = "tools" if constraint is not None else "response_format"
    constraint = constraint or await server.offload.run(response_constraint, body.response_format)
    if body.dry_multiplier:  # the breakers tokenized here, not on the engine thread (engine/dry_cache.py)
        breakers = body.dry_sequence_breakers
        breakers = DEFAULT_DRY_SEQUENCE_BREAKERS if breakers is None else tuple(breakers)
        await server.offload.run(server.engine.dry_cache.get, breakers)

    fixed = dict(max_tokens=max_tokens, logprobs=logprobs, prompt_len=n_prompt, constraint=constraint)
    fixed["skip_special_tokens"] = not (text_plan is not None and text_plan.keep_special)

    def make_params(index: int):
        seed = (body.seed + index) % SEED_LIMIT if body.seed is not None else None  # n choices must differ
        return lambda: sampling_params(body, seed=seed, **fixed)

    loop, events = asyncio.get_running_loop(), asyncio.Queue()

    def emit(event: Event) -> None:  # from the engine thread
        try:
            loop.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: the server is going away
            pass

    jobs = [Job(prompt_ids, make_params(i), i, emit) for i in range(body.n)]
    await open_jobs(server, jobs, events, constraint, param)
    model = body.model or server.model_id
    reply = Reply(server, chat, model, logprobs is not None, body.include_usage, len(jobs), text_plan)
    if body.stream:
        return EventStream(reply.stream(events), on_close=lambda: server.engine.cancel(jobs))
    try:
        result = await until_disconnect(request, reply.collect(events))
    finally:
        server.engine.cancel(jobs)  # a no-op for finished sequences
    return JSONResponse(result)


def completion_budget(
    ctx: int, n_prompt: int, chat: bool, limit: int | None, limit_param: str, prompt_param: str
) -> int:
    """The completion's max_tokens: the request's limit, else what the context leaves (capped for completions); a 400
    where the prompt fills the context or the limit does not fit beside it."""
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
        return room if chat else min(COMPLETIONS_DEFAULT_MAX_TOKENS, room)
    if limit > room:
        raise context_exceeded(
            f"This model's maximum context length is {ctx} tokens. However, you requested "
            f"{n_prompt + limit} tokens ({n_prompt} in the prompt, {limit} for the completion). "
            f"Please reduce the prompt or {limit_param}.",
            limit_param,
            n_prompt,
            ctx,
        )
    return limit


async def open_jobs(
    server: Server, jobs: list[Job], events: asyncio.Queue, constraint: Constraint | None, param: str
) -> None:
    """Submit the jobs and wait until every one is open. A constraint compiled before is checked at once; a new one
    on a worker beside the rows' opening and prefill (its queue may hold long prompts). A refusal or a bad grammar
    cancels every job and raises."""
    checking = None
    if constraint is not None and compiled_now(constraint):
        checked(constraint, param)
    elif constraint is not None:
        checking = asyncio.ensure_future(server.offload.run(checked, constraint, param))
    server.engine.submit(jobs)
    try:
        await wait_opened(events, len(jobs))
        if checking is not None:
            await checking  # a bad grammar: the 400, and its rows cancelled
    except BaseException:
        server.engine.cancel(jobs)
        if checking is not None:
            checking.add_done_callback(lambda done: done.cancelled() or done.exception())  # (read: no warning)
        raise


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
    if not task.done():  # the client left first: let the work's cancellation run (it frees the rows) before answering
        await asyncio.wait({task})
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
    tokens = await server.offload.run(loaded.tokenizer.encode, body.content, add_special_tokens=body.add_special)
    return JSONResponse({"tokens": tokens})


async def openapi(request: Request) -> Response:
    request.app.state.server.authorize(request)
    return JSONResponse(request.app.state.openapi)


async def detokenize(request: Request) -> Response:
    server: Server = request.app.state.server
    loaded = server.ready(request)
    body = await parse(request, DetokenizeRequest)
    ids = check_token_ids(body.tokens, loaded.tokenizer.vocab_size, "tokens")
    return JSONResponse({"content": await server.offload.run(loaded.tokenizer.decode, ids)})


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
    drain = Drain(config.http.shutdown_grace)  # started by connections.py's MlxcelServer

    @asynccontextmanager
    async def lifespan(app):
        server.engine.start()
        try:
            yield
        finally:
            server.offload.close()
            await asyncio.get_running_loop().run_in_executor(None, server.engine.stop)

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/openapi.json", openapi, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={APIError: api_error, HTTPException: http_error, Exception: server_error},
        middleware=middleware(config, drain),
    )
    app.state.server, app.state.drain = server, drain
    app.state.openapi = openapi_document(app.routes, __version__, bool(config.api_key))
    return app
