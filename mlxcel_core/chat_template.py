"""Render a model's Jinja chat template the way transformers does (sandboxed, trim/lstrip blocks)."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

from .errors import InputError


def _raise_exception(message: str):
    raise InputError(f"chat template: {message}")


def _tojson(value, indent=None, ensure_ascii=False, separators=None, sort_keys=False):
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool = True, **special_tokens) -> str:
    from jinja2 import TemplateError

    try:
        return _compile(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **special_tokens
        )
    except TemplateError as exc:
        raise InputError(f"chat template failed to render: {exc}") from exc
