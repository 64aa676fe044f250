"""Render a model's Jinja chat template the way transformers does (sandboxed, trim/lstrip blocks).

What transformers' apply_chat_template gives a template, so that templates written for it render the same here:
- globals `raise_exception`, `strftime_now` (the harmony template of gpt-oss prints today's date with it),
  `namespace` and `dict` (Jinja's own), the `tojson` filter without HTML escaping, loop controls, and the
  `{% generation %}` block (transformers tracks the assistant's tokens with it; rendering, it is its body);
- messages as transformers hands them over: keys whose value is None dropped (a template tests `"tool_calls" in
  message`), and a message's reasoning under `thinking` and `reasoning_content` whichever of `reasoning_content`,
  `thinking`, `reasoning` it came as (gpt-oss's template reads `thinking`, most others `reasoning_content`);
- any other keyword is a template variable (gpt-oss: `reasoning_effort`, `model_identity`, `builtin_tools`).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

from .errors import InputError

# Names a message's reasoning comes under (transformers' _REASONING_FIELDS); templates read the first or `thinking`.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _raise_exception(message: str):
    raise InputError(f"chat template: {message}")


def _tojson(value, indent=None, ensure_ascii=False, separators=None, sort_keys=False):
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _generation_extension():
    """The `{% generation %}...{% endgeneration %}` block: renders its body (transformers also records where)."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return Generation


@lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_generation_extension(), "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def template_messages(messages: list[dict]) -> list[dict]:
    """The messages as transformers hands them to a template: None values dropped, reasoning aliased."""
    out = []
    for message in messages:
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in _REASONING_FIELDS if key in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool = True, **variables) -> str:
    """`variables`: the special tokens (bos_token, eos_token) and any template variable (reasoning_effort, ...)."""
    from jinja2 import TemplateError

    try:
        return _compile(template).render(
            messages=template_messages(messages), add_generation_prompt=add_generation_prompt, **variables
        )
    except TemplateError as exc:
        raise InputError(f"chat template failed to render: {exc}") from exc
