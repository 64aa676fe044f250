"""Structured outputs: what a request constrains its output to, as plain data, and its grammar.

A `Constraint` (a field of SamplingParams) is the same for the server's `response_format`, the CLI's
`--json-schema` / `--regex` / `--grammar` and the Python API:

    kind          text                                   the output is
    json_schema   a JSON schema (JSON text)              one JSON value valid against the schema
    json_object   (none)                                 one JSON object
    regex         a regular expression (Rust syntax)     a full match of the expression
    grammar       a Lark grammar, or GBNF (llama.cpp)    a sentence of the grammar (start rule / root)

llguidance (https://github.com/guidance-ai/llguidance) turns each into its grammar format here; the engine's
mlxcel_core/engine/constrained.py runs it against the tokenizer (a token mask per step). JSON is written compactly
with fixed separators (`{"a": 1, "b": [2, 3]}`): no free whitespace a small model could loop in, and the fewest
tokens. A schema may override that with llguidance's top-level "x-guidance" key. Properties come in schema order.

Tool calls (server/tool_calls.py) reuse the same path: a Lark grammar with embedded JSON schemas is a `grammar`.
Only this module and engine/constrained.py import llguidance, and only inside functions (`mlxcel --help` and
code that never constrains output do not load it).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

from .errors import InputError

ConstraintKind = Literal["json_schema", "json_object", "regex", "grammar"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "grammar")
# Compact JSON with Python's separators; "x-guidance" in a schema overrides these defaults.
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_NAMES = {"json_schema": "JSON schema", "json_object": "JSON object", "regex": "regex", "grammar": "grammar"}


class ConstraintError(InputError):
    """The constraint itself is wrong (bad schema, regex or grammar; an unsupported schema feature)."""


@dataclass(frozen=True)
class Constraint:
    """What a row's output must match. Frozen and hashable: compiled grammars are cached by it."""

    kind: ConstraintKind
    text: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise InputError(f"constraint kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.text, str):
            raise InputError(f"constraint text must be a string, got {type(self.text).__name__}")
        if self.kind != "json_object" and not self.text.strip():
            raise ConstraintError(f"the {self.name} is empty")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool | str) -> "Constraint":
        """From a schema object, `true`, or its JSON text: ConstraintError when it is not JSON or not a schema."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ConstraintError(f"the JSON schema is not valid JSON: {exc}") from None
        if schema is True:  # the schema that accepts every JSON value
            schema = {}
        if not isinstance(schema, dict):
            what = "false (nothing matches it)" if schema is False else type(schema).__name__
            raise ConstraintError(f"a JSON schema must be an object, got {what}")
        return cls("json_schema", json.dumps(schema, ensure_ascii=False))

    @classmethod
    def json_object(cls) -> "Constraint":
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> "Constraint":
        return cls("regex", pattern)

    @classmethod
    def grammar(cls, text: str) -> "Constraint":
        """A Lark grammar (llguidance's dialect) or a GBNF grammar (llama.cpp's), told apart by llguidance."""
        return cls("grammar", text)

    @property
    def name(self) -> str:
        return _NAMES[self.kind]

    @property
    def is_json(self) -> bool:
        """The output is one JSON value (so callers can parse it)."""
        return self.kind in ("json_schema", "json_object")


COMPILED_CACHE_SIZE = 256  # constraints whose grammar (or error) is kept
_lock = threading.Lock()
_compiled_cache: OrderedDict[Constraint, Future] = OrderedDict()  # constraint -> (grammar, error), single flight


def _compiled(constraint: Constraint) -> tuple[str, str]:
    """(llguidance grammar, error message or ""), computed once per constraint (validating costs ~0.5-1 ms a schema).
    Threads asking for one constraint at once wait for one computation (the server's check and the engine's compile
    of a new schema run side by side)."""
    with _lock:
        future = _compiled_cache.get(constraint)
        owner = future is None
        if owner:
            future = _compiled_cache[constraint] = Future()
            if len(_compiled_cache) > COMPILED_CACHE_SIZE:
                _compiled_cache.popitem(last=False)
        else:
            _compiled_cache.move_to_end(constraint)
    if owner:
        try:
            result = _compile(constraint)
        except BaseException as exc:  # e.g. llguidance missing: the waiters see it, a later call tries again
            with _lock:
                if _compiled_cache.get(constraint) is future:
                    del _compiled_cache[constraint]
            future.set_exception(exc)
            raise
        future.set_result(result)
    return future.result()


def compiled_now(constraint: Constraint) -> bool:
    """The constraint's grammar (or its error) is known: `grammar_of` answers at once."""
    with _lock:
        future = _compiled_cache.get(constraint)
    return future is not None and future.done()


def _compile(constraint: Constraint) -> tuple[str, str]:
    import llguidance

    try:
        if constraint.kind == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
        elif constraint.kind == "json_schema":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(constraint.text, defaults=JSON_DEFAULTS)
        elif constraint.kind == "regex":
            grammar = llguidance.grammar_from("regex", constraint.text)
        else:
            grammar = llguidance.grammar_from("grammar", constraint.text)  # Lark, or GBNF converted to Lark
    except (ValueError, TypeError) as exc:
        return "", _one_line(str(exc))
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None, limits=_limits())
    return grammar, _one_line(messages[0]) if is_error else ""


def grammar_of(constraint: Constraint) -> str:
    """The llguidance grammar of a constraint; ConstraintError naming the problem when it has none."""
    grammar, error = _compiled(constraint)
    if error:
        if constraint.kind != "grammar":  # a position in the generated grammar means nothing to the user
            error = re.sub(r'^at \d+\(\d+\): (invalid regex ".*" \(in regex\): )?', "", error)
        raise ConstraintError(f"invalid {constraint.name}: {error}")
    return grammar


def check(constraint: Constraint | None) -> None:
    """Raise ConstraintError if the constraint cannot be compiled (the CLI calls it before any model work; the server
    beside the row's prefill, then refuses the request)."""
    if constraint is not None:
        grammar_of(constraint)


def _limits():
    """llguidance's default limits, with short error messages (no parser state dumps)."""
    import llguidance

    return llguidance.LLParserLimits(verbose_errors=False)


def _one_line(message: str) -> str:
    """llguidance's messages can span lines (a caret under the grammar): one line for the user."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return "unknown error"
    details = [line.removeprefix("error:").strip() for line in lines[1:] if line.startswith("error:")]
    return " ".join([lines[0], *details])


def parse_json(text: str) -> Any:
    """The JSON value a json constraint produced, or None when the text is not (yet) one (cut by max_tokens)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None
