"""`mlxcel serve`: the OpenAI-compatible HTTP server. Parses flags, binds the socket, runs uvicorn.

The model loads in the background once the socket is up (/health says 503 until it is ready); if it
fails to load, the server stops and the command exits with the load error's exit status.
"""

from __future__ import annotations

import json
import logging
import socket
import sys
from typing import Annotated, Optional

import typer

from . import options as opt
from .adapter_option import AdapterPath, check_adapter
from .completion import complete_model
from .errors import fail, reported_errors
from .progress_line import hub_download_bars
from .tp import TpSize, follow_leader, join_ranks


def _opt(*names: str, env: str, help: str, **kw):
    return typer.Option(*names, envvar=env, help=help, **kw)


Model = Annotated[
    Optional[str],
    _opt(
        "-m",
        "--model",
        env="MLXCEL_MODEL",
        metavar="MODEL",
        help="Model directory, .gguf file, Hugging Face repo id or catalogue name (`mlxcel ls --catalog`). "
        "Default: SmolLM2-135M-Instruct.",
        autocompletion=complete_model,
    ),
]
Host = Annotated[str, _opt("--host", env="MLXCEL_HOST", help="Address to listen on.")]
Port = Annotated[
    int,
    _opt(
        "--port", env="MLXCEL_PORT", min=0, max=65535, help="Port to listen on; 0 picks a free one (printed on stderr)."
    ),
]
ApiKey = Annotated[
    Optional[str],
    _opt(
        "--api-key",
        env="MLXCEL_API_KEY",
        show_default=False,
        help="Require 'Authorization: Bearer KEY' on every route but /health.",
    ),
]
Parallel = Annotated[
    int,
    _opt("--parallel", "--n-parallel", env="MLXCEL_PARALLEL", min=1, help="Sequences decoded together in one batch."),
]
MaxBatch = Annotated[
    Optional[int],
    _opt(
        "--max-batch-size",
        env="MLXCEL_MAX_BATCH_SIZE",
        min=1,
        help="Rows per engine step (overrides --parallel). Default: --parallel.",
    ),
]
MaxQueue = Annotated[
    int,
    _opt(
        "--max-queue-depth",
        env="MLXCEL_MAX_QUEUE_DEPTH",
        min=0,
        help="Sequences that may wait for a batch slot; more get 503.",
    ),
]
PrefillChunk = Annotated[
    Optional[int],
    _opt("--prefill-chunk-size", env="MLXCEL_PREFILL_CHUNK_SIZE", min=1, help=opt.PREFILL_CHUNK_HELP),
]
PrefillBatch = Annotated[
    Optional[int],
    _opt(
        "--prefill-batch",
        env="MLXCEL_PREFILL_BATCH",
        metavar="N",
        min=1,
        help="Waiting prompts prefilled together in one forward (paged KV "
        "without --kv-bits). Default: 8 on a GPU, 1 on CPU.",
    ),
]
Storage = Annotated[
    str,
    _opt(
        "--decode-storage-backend",
        env="MLXCEL_DECODE_STORAGE_BACKEND",
        help="KV storage: auto (paged when batching or on CUDA, else dense), dense or paged.",
    ),
]
CtxSize = Annotated[
    int,
    _opt(
        "--ctx-size",
        env="MLXCEL_CTX_SIZE",
        min=0,
        help="Cap the context (prompt + completion tokens); 0 = the model's.",
    ),
]
MaxN = Annotated[int, _opt("--max-n", env="MLXCEL_MAX_N", min=1, help="Largest `n` (choices) a request may ask for.")]
KvBits = Annotated[
    Optional[int], _opt("--kv-bits", env="MLXCEL_KV_BITS", help="Store the KV cache quantized to 8 or 4 bits.")
]
DraftModel = Annotated[
    Optional[str],
    _opt(
        "--draft-model",
        env="MLXCEL_DRAFT_MODEL",
        metavar="MODEL",
        help="Speculative decoding with this smaller model (same tokenizer). "
        "A request speculates while it decodes alone; batched rows decode plainly.",
        autocompletion=complete_model,
    ),
]
DraftNgram = Annotated[
    int,
    _opt(
        "--draft-ngram",
        env="MLXCEL_DRAFT_NGRAM",
        metavar="N",
        min=0,
        help="Speculative decoding by prompt lookup (n-grams up to N); 0 = off.",
    ),
]
NumDraftTokens = Annotated[
    int,
    _opt(
        "--num-draft-tokens",
        env="MLXCEL_NUM_DRAFT_TOKENS",
        metavar="K",
        help="Speculative decoding: tokens drafted per round (1-64).",
    ),
]
Warmup = Annotated[
    bool,
    _opt(
        "--warmup/--no-warmup",
        env="MLXCEL_WARMUP",
        help="Run short requests before /health turns 200 (on a GPU: a lone reply the CUDA "
        "graph records, decode batches of every size up to 8, prompts of 1 to 8 tokens), "
        "so that no client waits for GPU kernels to compile.",
    ),
]
ParseSpecialInContent = Annotated[
    bool,
    _opt(
        "--parse-special-in-content",
        env="MLXCEL_PARSE_SPECIAL_IN_CONTENT",
        help="Chat: turn special-token text inside message content (e.g. '<|im_end|>') into control tokens. By "
        "default it is plain text: control tokens come only from the chat template, so a client cannot forge a "
        "turn. /v1/completions prompts are raw text and always parse special tokens.",
    ),
]
LogFormat = Annotated[
    str,
    _opt("--log-format", env="MLXCEL_LOG_FORMAT", help="Log lines on stderr as text or json (one object per line)."),
]
MaxBodySize = Annotated[
    str,
    _opt(
        "--max-body-size",
        env="MLXCEL_MAX_BODY_SIZE",
        metavar="SIZE",
        help="Largest request body, in bytes or with a K, M or G suffix; a larger one gets 413.",
    ),
]
HeaderTimeout = Annotated[
    float,
    _opt(
        "--header-timeout",
        env="MLXCEL_HEADER_TIMEOUT",
        metavar="SECONDS",
        help="Time a client has to send a request's headers; then 408 and the connection is closed.",
    ),
]
BodyTimeout = Annotated[
    float,
    _opt(
        "--body-timeout",
        env="MLXCEL_BODY_TIMEOUT",
        metavar="SECONDS",
        help="Time a client has to send a request's body once its headers are in; then 408 and the "
        "connection is closed.",
    ),
]
MaxConnections = Annotated[
    int,
    _opt(
        "--max-connections",
        env="MLXCEL_MAX_CONNECTIONS",
        min=1,
        help="Open connections at most; one more gets 503 and is closed (fewer when the open-file limit "
        "cannot be raised to fit them).",
    ),
]
ShutdownGrace = Annotated[
    float,
    _opt(
        "--shutdown-grace",
        env="MLXCEL_SHUTDOWN_GRACE",
        metavar="SECONDS",
        min=0,
        help="On Ctrl-C or SIGTERM, time running requests have to finish; then each ends with an error "
        "(503, or in a stream an error event and [DONE]).",
    ),
]
AllowedOrigins = Annotated[
    Optional[str],
    _opt(
        "--allowed-origins",
        env="MLXCEL_ALLOWED_ORIGINS",
        metavar="LIST",
        show_default=False,
        help="Web page origins that may use the server besides localhost: a comma list, * as a wildcard, "
        "'*' alone for any (as OLLAMA_ORIGINS). Without --api-key other origins get 403.",
    ),
]


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def _configure_logging(log_format: str, verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        _JsonFormatter()
        if log_format == "json"
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    from mlxcel_core.server.log_limit import RepeatFilter

    handler.addFilter(RepeatFilter())  # one warning repeated by a flood of clients: a few lines a minute
    for name in ("mlxcel", "uvicorn", "uvicorn.error", "uvicorn.access", "asyncio"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler] if name in ("mlxcel", "uvicorn", "asyncio") else []
        logger.propagate = name not in ("mlxcel", "uvicorn", "asyncio")
        logger.setLevel(logging.DEBUG if verbose else logging.INFO)


def _bind(host: str, port: int) -> socket.socket:
    from mlxcel_core.errors import InputError

    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        # Listening from here on: a client that connects as soon as the "listening on" line appears waits in the
        # backlog until uvicorn accepts, instead of being refused while the app starts.
        sock.listen(2048)
    except OSError as exc:
        raise InputError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def _http_config(max_body_size: str, header_timeout: float, body_timeout: float, connections: int, grace: float):
    from mlxcel_core.server.connections import fit_to_fd_limit
    from mlxcel_core.server.http_config import HttpConfig, parse_size

    try:
        max_body = parse_size(max_body_size)
    except ValueError as exc:
        raise fail(f"--max-body-size: {exc}") from None
    if max_body < 1:
        raise fail("--max-body-size must be at least 1 byte")
    for flag, value in (("--header-timeout", header_timeout), ("--body-timeout", body_timeout)):
        if not 0 < value < float("inf"):
            raise fail(f"{flag} must be a number of seconds > 0, got {value}")
    fitted = fit_to_fd_limit(connections)
    if fitted < connections:
        print(f"mlxcel: --max-connections lowered to {fitted} to fit the open-file limit", file=sys.stderr)
    return HttpConfig(max_body, header_timeout, body_timeout, fitted, grace)


def _run_until_stopped(server, sock: socket.socket) -> None:
    """Serve until Ctrl-C (exit 130 after the graceful shutdown, as any interrupted command) or SIGTERM (exit 0:
    a stop asked for by a service manager). uvicorn handles both the same way, then raises the signal again once
    it has shut down: SIGTERM's own handler here takes that, instead of the default one that kills the process."""
    import signal

    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)


def serve(
    model: Model = None,
    host: Host = "127.0.0.1",
    port: Port = 8080,
    api_key: ApiKey = None,
    parallel: Parallel = 4,
    max_batch_size: MaxBatch = None,
    max_queue_depth: MaxQueue = 32,
    prefill_chunk_size: PrefillChunk = None,
    prefill_batch: PrefillBatch = None,
    storage: Storage = "auto",
    ctx_size: CtxSize = 0,
    max_n: MaxN = 4,
    kv_bits: KvBits = None,
    draft_model: DraftModel = None,
    draft_ngram: DraftNgram = 0,
    num_draft_tokens: NumDraftTokens = 5,
    warmup: Warmup = True,
    parse_special_in_content: ParseSpecialInContent = False,
    log_format: LogFormat = "text",
    max_body_size: MaxBodySize = "16M",
    header_timeout: HeaderTimeout = 10.0,
    body_timeout: BodyTimeout = 60.0,
    max_connections: MaxConnections = 1024,
    shutdown_grace: ShutdownGrace = 5.0,
    allowed_origins: AllowedOrigins = None,
    tp_size: TpSize = 1,
    adapter_path: AdapterPath = None,
    verbose: opt.Verbose = False,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API.

    Routes: POST /v1/completions, POST /v1/chat/completions (stream: true for server-sent events),
    GET /v1/models, GET /health, GET /metrics (Prometheus), POST /tokenize, POST /detokenize.
    Every option can also come from the MLXCEL_* environment variable named in --help.
    """
    with reported_errors(verbose):
        if log_format not in ("text", "json"):
            raise fail(f"--log-format must be text or json, got '{log_format}'")
        from mlxcel_core.server.http_config import parse_origins

        http = _http_config(max_body_size, header_timeout, body_timeout, max_connections, shutdown_grace)
        http.allowed_origins = parse_origins(allowed_origins or "")
        speculative = opt.speculative_config(draft_model, draft_ngram, num_draft_tokens)
        engine_config = opt.engine_config(
            max_batch_size or parallel, kv_bits, storage, prefill_chunk_size, speculative, prefill_batch
        )
        check_adapter(adapter_path, tp_size)
        hub_download_bars(log_format == "json")  # JSON log lines: no bars between them
        group, _ = join_ranks(tp_size, verbose=verbose)
        if group is not None and group.rank() > 0:  # only rank 0 serves HTTP; this rank mirrors its engine
            follow_leader(group, model, engine_config)
            return
        _configure_logging(log_format, verbose)

        from mlxcel_core.server import ServerConfig, create_app
        from mlxcel_core.server.connections import uvicorn_server

        config = ServerConfig(
            model=model,
            engine=engine_config,
            api_key=api_key or None,
            max_queue_depth=max_queue_depth,
            max_n=max_n,
            ctx_size=ctx_size or None,
            group=group,
            warmup=warmup,
            http=http,
            parse_special_in_content=parse_special_in_content,
            adapter_path=adapter_path,
        )
        failed: list[BaseException] = []
        holder: dict = {}

        def on_load_failed(exc: BaseException) -> None:  # engine thread: stop serving, report after
            failed.append(exc)
            holder["server"].should_exit = True

        app = create_app(config, on_load_failed=on_load_failed)
        sock = _bind(host, port)
        server = holder["server"] = uvicorn_server(app)
        bound_host, bound_port = sock.getsockname()[:2]
        http.bind_host = bound_host  # loopback: the Host header check is on (server/browsers.py)
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        print(
            f"mlxcel: listening on http://{shown}:{bound_port} (model loading in the background)",
            file=sys.stderr,
            flush=True,
        )
        _run_until_stopped(server, sock)
        if failed:
            from mlxcel_core.distributed import lost_peer_errors

            with lost_peer_errors(group):
                raise failed[0]
