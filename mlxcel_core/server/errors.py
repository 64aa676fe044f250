"""The OpenAI error envelope: {"error": {"message", "type", "param", "code"}}, `code` being the HTTP status.

`type` uses llama.cpp's names (invalid_request_error 400, 408 and 413, authentication_error 401, permission_error
403, not_found_error 404, server_error 500, unavailable_error 503, exceed_context_size_error 400 with
n_prompt_tokens / n_ctx).
Every client mistake becomes an APIError with a 4xx status before anything reaches the engine.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    501: "not_supported_error",
    503: "unavailable_error",
}
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "tuple", "namedtoolchoice"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type: str | None = None, **extra: Any):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type = type or TYPES.get(status, "server_error")
        self.extra = extra

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.status,
                **self.extra,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)

    def sse(self) -> bytes:
        """The error as one server-sent event (a failure after the stream started)."""
        return f"data: {json.dumps(self.body(), ensure_ascii=False)}\n\n".encode()


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def context_exceeded(message: str, param: str, n_prompt_tokens: int, n_ctx: int) -> APIError:
    return APIError(400, message, param, "exceed_context_size_error", n_prompt_tokens=n_prompt_tokens, n_ctx=n_ctx)


def _param(loc: tuple) -> str | None:
    """pydantic's error location as an OpenAI `param`: ('messages', 0, 'content') -> 'messages[0].content'.

    Union members add their type name to the location ('prompt', 'list[int]', 1); those tags are dropped.
    """
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part.lower() in _TYPE_TAGS:
            continue
        else:
            out += f".{part}" if out else part
    return out or None


def from_validation_error(exc) -> APIError:
    """The first failing parameter of a pydantic ValidationError, named in `param` and in the message."""
    errors = exc.errors(include_url=False)
    if any(e["type"] == "json_invalid" for e in errors):
        detail = next(e["msg"] for e in errors if e["type"] == "json_invalid")
        return bad_request(f"The request body is not valid JSON: {detail}")
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    param = _param(first["loc"])
    if param is None:  # the body itself: not an object
        return bad_request(f"The request body must be a JSON object: {first['msg']}")
    top = first["loc"][0]
    messages = list(dict.fromkeys(e["msg"] for e in errors if e["loc"] and e["loc"][0] == top))
    if first["type"] == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param)
    return bad_request(f"Invalid value for '{param}': {' or '.join(messages)}.", param)


def from_core_error(exc: Exception) -> APIError:
    """mlxcel_core errors: the user's (InputError) -> 400 (a bad constraint names response_format), else 500."""
    from ..constraints import ConstraintError
    from ..errors import InputError

    if isinstance(exc, InputError):
        return bad_request(str(exc), "response_format" if isinstance(exc, ConstraintError) else None)
    return APIError(500, f"{type(exc).__name__}: {exc}")
