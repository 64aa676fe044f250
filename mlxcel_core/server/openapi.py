"""The OpenAPI 3.1 document served at GET /openapi.json: every route of the app's route table, each POST route's
request body as the pydantic schema the route parses it with (schemas.py, `model_json_schema`'s JSON Schema), one
example body per route (tests post each one to a real server), and the OpenAI error envelope of every 4xx/5xx.

The document describes what the parser accepts, not every check a route makes after parsing (the context length,
`n` against --max-n, token ids against the vocabulary): such requests validate here and get a 400 from the route.
"""

from __future__ import annotations

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from .schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

REF = "#/components/schemas/{model}"

# path -> (the body's schema, an example body) for the routes that take a JSON body
REQUEST_BODIES: dict[str, tuple[type[BaseModel], dict]] = {
    "/v1/completions": (CompletionRequest, {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}),
    "/v1/chat/completions": (
        ChatCompletionRequest,
        {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0},
    ),
    "/tokenize": (TokenizeRequest, {"content": "Hello world"}),
    "/detokenize": (DetokenizeRequest, {"tokens": [1, 2, 3]}),
}

SUMMARIES = {
    "/v1/completions": "Complete a raw prompt (text or token ids); `stream` for server-sent events.",
    "/v1/chat/completions": "Answer a conversation through the model's chat template; `stream` for server-sent events.",
    "/v1/models": "The served model.",
    "/health": 'Whether the model is loaded and the engine runs: 200 {"status": "ok"}, else 503. No key needed.',
    "/metrics": "Prometheus metrics (text exposition format).",
    "/tokenize": "Token ids of a text.",
    "/detokenize": "The text of token ids.",
    "/openapi.json": "This document.",
}

_SUCCESS_TYPES = {
    "/metrics": "text/plain",
    "/v1/completions": ("application/json", "text/event-stream"),
    "/v1/chat/completions": ("application/json", "text/event-stream"),
}

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": "integer"},
            },
        }
    },
}


def openapi_document(routes, version: str, api_key: bool) -> dict:
    """The document of `routes` (the app's starlette Routes); `api_key`: whether the routes need a bearer token."""
    bodies = sorted({schema for schema, _ in REQUEST_BODIES.values()}, key=lambda s: s.__name__)
    _, defs = models_json_schema([(s, "validation") for s in bodies], ref_template=REF)
    components: dict = {"schemas": {**defs.get("$defs", {}), "ErrorResponse": _ERROR}}
    if api_key:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    paths: dict = {}
    for route in routes:
        for method in sorted(set(route.methods or ()) - {"HEAD"}):
            paths.setdefault(route.path, {})[method.lower()] = _operation(route.path, api_key)
    return {
        "openapi": "3.1.0",
        "info": {"title": "mlxcel", "version": version, "description": "OpenAI-compatible inference server."},
        "paths": paths,
        "components": components,
    }


def _operation(path: str, api_key: bool) -> dict:
    types = _SUCCESS_TYPES.get(path, "application/json")
    types = (types,) if isinstance(types, str) else types
    error = {
        "description": "The OpenAI error envelope.",
        "content": {"application/json": {"schema": _ref("ErrorResponse")}},
    }
    operation: dict = {
        "summary": SUMMARIES[path],
        "responses": {"200": {"description": "OK", "content": {t: {} for t in types}}, "4XX": error, "5XX": error},
    }
    if path in REQUEST_BODIES:
        schema, example = REQUEST_BODIES[path]
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": _ref(schema.__name__), "example": example}},
        }
    if api_key and path != "/health":
        operation["security"] = [{"bearer": []}]
    return operation


def _ref(name: str) -> dict:
    return {"$ref": REF.format(model=name)}
