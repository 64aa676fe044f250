"""Tool calls: which call format a chat template teaches its model, parsing a reply into OpenAI `tool_calls`, the
Lark grammar that forces a call (tool_choice "required" or a named function), and holding back streamed text.

Families, told apart by the chat template's text (the first that matches):
    hermes    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call (Qwen, Hermes, SmolLM3...);
              a reply that is nothing but such objects (maybe in a ```json fence) is read as calls too, as llama.cpp
              does: small models (Qwen2.5-Coder-0.5B) often leave the tags out
    mistral   `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`
    llama3    the whole reply is `{"name": ..., "parameters": {...}}`, maybe after `<|python_tag|>` (Llama 3.1+)
    harmony   gpt-oss: a `commentary` message to `functions.NAME` (mlxcel_core/harmony.py; one call per turn)
A template of none of these (or none at all) is parsed as hermes. Parsing is all or nothing: a reply whose call
text does not parse as JSON calls is returned as content, as vLLM does. With parallel_tool_calls false a reply's
first call is kept and the reply is cut after it (later calls, and text after the first call, are dropped).
No MLX; llguidance only to check a grammar.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass

FAMILIES = ("hermes", "mistral", "llama3", "harmony")
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
MISTRAL_START = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"
FENCE = "```"
_ALNUM = string.ascii_letters + string.digits


def detect_family(template: str | None) -> str:
    """The call format a chat template renders (see the module docstring); "hermes" when it names none."""
    template = template or ""
    if "<|channel|>" in template:
        return "harmony"
    if HERMES_START in template:
        return "hermes"
    if MISTRAL_START in template:
        return "mistral"
    if PYTHON_TAG in template or ("<|eot_id|>" in template and '"parameters"' in template):
        return "llama3"
    return "hermes"


def call_id(family: str) -> str:
    """A new call id: "call_" and 24 random characters; Mistral's templates insist on 9 alphanumerics."""
    n = 9 if family == "mistral" else 24
    return ("" if family == "mistral" else "call_") + "".join(secrets.choice(_ALNUM) for _ in range(n))


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON text, as OpenAI sends it

    def to_openai(self, family: str, id_: str | None = None) -> dict:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": id_ or call_id(family), "type": "function", "function": function}


def _call(obj) -> ToolCall | None:
    """{"name": ..., "arguments" | "parameters": {...}} as a ToolCall, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_values(text: str, separators: str) -> list | None:
    """The JSON values that make up the whole text, separated by any of `separators` or whitespace; else None."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or (values and text[i] in separators)):
            i += 1
        if i == len(text):
            return values or None
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        values.append(value)


def _unfenced(text: str) -> str:
    """The text inside a Markdown code fence (```, ```json) around the whole of it; else the text."""
    if not text.startswith(FENCE):
        return text
    head, _, body = text.partition("\n")
    if head[len(FENCE) :].strip() not in ("", "json") or not body.rstrip().endswith(FENCE):
        return text
    return body.rstrip()[: -len(FENCE)].strip()


def _bare_calls(text: str) -> list[ToolCall]:
    """A reply that is nothing but call objects (maybe in a fence), as calls; else []."""
    body = _unfenced(text.strip())
    calls = [_call(v) for v in _json_values(body, "") or []] if body.startswith("{") else []
    return [] if None in calls else calls


def parse_hermes(text: str) -> tuple[list[ToolCall], str]:
    """`<tool_call>{...}</tool_call>` blocks (the last may be unclosed), or a reply of bare call objects: (calls, the
    text outside them)."""
    start = text.find(HERMES_START)
    if start < 0:
        calls = _bare_calls(text)
        return (calls, "") if calls else ([], text)
    calls, outside, i = [], [text[:start]], start
    while i >= 0:
        body_at = i + len(HERMES_START)
        end = text.find(HERMES_END, body_at)
        body = text[body_at:] if end < 0 else text[body_at:end]
        values = _json_values(body.strip(), "")
        call = _call(values[0]) if values and len(values) == 1 else None
        if call is None:
            return [], text
        calls.append(call)
        if end < 0:
            break
        after = end + len(HERMES_END)
        i = text.find(HERMES_START, after)
        outside.append(text[after:] if i < 0 else text[after:i])
    return calls, "".join(outside)


def parse_mistral(text: str) -> tuple[list[ToolCall], str]:
    """`[TOOL_CALLS]` then a JSON list of calls (or the whole reply such a list: the marker is a special token,
    left out of decoded text): (calls, the text before the marker)."""
    start = text.find(MISTRAL_START)
    before, body = (text, text) if start < 0 else (text[:start], text[start + len(MISTRAL_START) :])
    if start < 0 and not text.lstrip().startswith("[{"):
        return [], text
    values = _json_values(body.strip(), "")
    if not values or len(values) != 1 or not isinstance(values[0], list) or not values[0]:
        return [], text
    calls = [_call(v) for v in values[0]]
    if None in calls:
        return [], text
    return calls, "" if start < 0 else before


def parse_llama3(text: str) -> tuple[list[ToolCall], str]:
    """The whole reply is one call object (or several separated by ";"), maybe after `<|python_tag|>`."""
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if not body.startswith("{"):
        return [], text
    values = _json_values(body, ";")
    calls = [_call(v) for v in values or []]
    if not calls or None in calls:
        return [], text
    return calls, ""


def parse_harmony(text: str) -> tuple[list[ToolCall], str]:
    """Messages to `functions.NAME` (the text decoded with its special tokens): (calls, the answer's text)."""
    from ..harmony import split

    reply = split(text)
    return [ToolCall(name, args) for name, args in reply.calls], reply.content


PARSERS = {"hermes": parse_hermes, "mistral": parse_mistral, "llama3": parse_llama3, "harmony": parse_harmony}


def parse(family: str, text: str, parallel: bool = True) -> tuple[list[ToolCall], str]:
    """A reply's tool calls and the text outside them (the whole text, and no calls, when it holds none).
    Not `parallel`: the first call only, the reply cut after it."""
    calls, outside = PARSERS[family](text)
    if parallel or len(calls) < 2:
        return calls, outside
    if family == "hermes" and HERMES_START in text:  # the text outside is what comes before the first call's end
        end = text.find(HERMES_END, text.find(HERMES_START))
        calls, outside = parse_hermes(text[: end + len(HERMES_END)])
    return calls[:1], outside


# -- forcing a call -------------------------------------------------------------------------------------------------
def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def call_grammar(family: str, tools: list[dict], parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect) whose sentences are one call of one of `tools` (OpenAI tool dicts) in
    the family's format, or with `parallel` one or more; each call's arguments match its tool's parameters schema."""
    from ..constraints import JSON_DEFAULTS

    rules, names = [], []
    key = "parameters" if family == "llama3" else "arguments"
    for i, tool in enumerate(tools):
        fn = tool["function"]
        schema = dict(fn.get("parameters") or {"type": "object"})
        schema.setdefault("x-guidance", {"whitespace_flexible": True} if family == "harmony" else JSON_DEFAULTS)
        if family == "harmony":  # the arguments are the whole message (special tokens are `<|...|>` in Lark)
            head = _lit(f"commentary to=functions.{fn['name']} ")
            rules.append(f'call_{i}: <|channel|> {head} <|constrain|> "json" <|message|> args_{i}')
        else:
            head = '{"name": ' + _lit(fn["name"]) + ', "' + key + '": '
            rules.append(f"call_{i}: {_lit(head)} args_{i} " + '"}"')
        rules.append(f"args_{i}: %json " + json.dumps(schema, ensure_ascii=False))
        names.append(f"call_{i}")
    rules.append("call: " + " | ".join(names))
    if family == "hermes":
        rules.append(f"block: {_lit(HERMES_START + chr(10))} call {_lit(chr(10) + HERMES_END)}")
        start = 'start: block ("\\n" block)*' if parallel else "start: block"
    elif family == "harmony":  # one call a turn; the analysis may come first
        start = "start: analysis? call"
        rules.append('analysis: <|channel|> "analysis" <|message|> /(.|\\n)*/ <|end|> <|start|> "assistant"')
    elif family == "mistral":
        start = 'start: "[" call (", " call)* "]"' if parallel else 'start: "[" call "]"'
    else:
        start = 'start: call ("; " call)*' if parallel else "start: call"
    return "\n".join([start, *rules]) + "\n"


def plan_tools(body, template: str | None) -> tuple[str | None, dict, object]:
    """A chat request's tools (schemas.ChatCompletionRequest): (the family its reply is parsed as, None for no
    parsing; the chat template's variables, chat_template_kwargs among them; the Constraint of tool_choice
    "required" or a named function: calls in the family's format, of any tool or of the named one). tool_choice
    "none" renders no tools, as vLLM does; a named function is called once, as vLLM does."""
    from ..constraints import Constraint
    from .errors import bad_request

    mode, name = body.tool_mode()
    variables = dict(body.chat_template_kwargs or {})
    if mode == "none":
        return None, variables, None
    family, tools = detect_family(template), body.template_tools()
    variables["tools"] = tools
    if mode == "auto":
        return family, variables, None
    if body.response_format is not None and body.response_format.type != "text":
        raise bad_request("response_format cannot be combined with a required tool_choice.", "tool_choice")
    forced = [t for t in tools if name is None or t["function"]["name"] == name]
    # (whether the grammar compiles, e.g. with the tools' schemas in it, is request_params.checked's question)
    grammar = call_grammar(family, forced, body.parallel_tool_calls and name is None)
    return family, variables, Constraint.grammar(grammar)


# -- streaming ------------------------------------------------------------------------------------------------------
def _may_be_bare_calls(lead: str) -> bool:
    """Whether a reply beginning with `lead` (no leading space) may still be bare call objects (parse_hermes)."""
    if not lead or lead[0] == "{":
        return True
    if not (lead.startswith(FENCE) or FENCE.startswith(lead)):
        return False
    head, newline, body = lead.partition("\n")
    return not newline or (
        head[len(FENCE) :].strip() in ("", "json") and (not body.lstrip() or body.lstrip()[0] == "{")
    )


class StreamSplitter:
    """A streamed choice's text: the content that may go out now, holding back from where a call may begin."""

    def __init__(self, family: str, parallel: bool = True):
        self.family, self.parallel, self.text, self.sent, self.held = family, parallel, "", 0, False
        self.maybe_bare = family == "hermes"  # the reply may still be bare call objects (once not, never again)

    def _hold_from(self) -> int:
        text = self.text
        if self.family == "llama3" or (self.family == "mistral" and text.lstrip().startswith("[")):
            lead = text.lstrip()
            if not lead or lead[0] in "{[" or PYTHON_TAG.startswith(lead[: len(PYTHON_TAG)]):
                return 0  # (the whole reply may be a call)
            if self.family == "llama3":
                return len(text)
        if self.maybe_bare:
            self.maybe_bare = _may_be_bare_calls(text.lstrip())
            if self.maybe_bare:
                return 0
        marker = HERMES_START if self.family == "hermes" else MISTRAL_START
        at = text.find(marker)
        if at >= 0:
            self.held = True
            return at
        for k in range(min(len(marker) - 1, len(text)), 0, -1):  # a marker's beginning at the end
            if marker.startswith(text[-k:]):
                return len(text) - k
        return len(text)

    def feed(self, piece: str) -> str:
        """Add streamed text; return the content safe to send now."""
        self.text += piece
        if self.held:
            return ""
        end = self._hold_from()
        out, self.sent = self.text[self.sent : max(end, self.sent)], max(end, self.sent)
        return out

    def finish(self) -> tuple[list[ToolCall], str]:
        """At the end: the calls, and the content not yet sent."""
        calls, outside = parse(self.family, self.text, self.parallel)
        if not calls:
            return [], self.text[self.sent :]
        return calls, outside[self.sent :] if outside.startswith(self.text[: self.sent]) else ""
