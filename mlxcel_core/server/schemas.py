"""Request bodies of the OpenAI-compatible routes (pydantic v2, validated from the raw JSON bytes).

Strict types (a string is never coerced into a number), finite floats only, unknown fields ignored
(clients send extras such as `user`), `null` the same as an absent field (OpenAI's clients send `"temperature":
null` for "the default"). Ranges follow OpenAI where it has one.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from ..processors import DRY_MAX_BREAKER_CHARS, DRY_MAX_BREAKERS
from .errors import bad_request

MAX_STOP_STRINGS = 16


SEED_RANDOM = -1  # llama.cpp's "pick a random seed"
SEED_LIMIT = 2**64  # seeds are unsigned 64-bit integers


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")

    @field_validator("*", mode="before")
    @classmethod
    def _null_is_the_default(cls, value, info: ValidationInfo):
        """`null` for a field that has a default means that default (a required field stays required)."""
        field = cls.model_fields[info.field_name]
        if value is None and not field.is_required():
            return field.get_default(call_default_factory=True)
        return value


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    """response_format.json_schema: OpenAI's structured outputs (the schema is enforced whatever `strict` says)."""

    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Union[dict[str, Any], bool, None] = Field(None, alias="schema")  # absent: any JSON value
    strict: Optional[bool] = None


class ResponseFormat(_Body):
    """{"type": "text"} (free text), {"type": "json_object"} or {"type": "json_schema", "json_schema": {...}}."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class SamplingFields(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: Optional[str] = None  # absent: the served model
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)  # -1 or 0: off
    min_p: float = Field(0.0, ge=0, le=1)
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = Field(None, validate_default=True)  # -> list[str]
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    logit_bias: Optional[dict[str, float]] = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    # llama.cpp names for what OpenAI does not have (applied in the order of mlxcel_core/sampling.py)
    repeat_penalty: Optional[float] = Field(None, gt=0)  # 1 = off
    repetition_penalty: Optional[float] = Field(None, gt=0)  # the same knob under vLLM / transformers' name
    repeat_last_n: int = Field(64, ge=-1)  # -1 = every token, 0 = none
    dry_multiplier: float = Field(0.0, ge=0)  # 0 = off
    dry_base: float = Field(1.75, ge=1)
    dry_allowed_length: int = Field(2, ge=1)
    dry_penalty_last_n: int = Field(-1, ge=-1)  # -1 = the whole context, 0 = off
    dry_sequence_breakers: Optional[list[str]] = None  # None: llama.cpp's defaults ["\n", ":", "\"", "*"]
    xtc_threshold: float = Field(0.1, ge=0, le=1)
    xtc_probability: float = Field(0.0, ge=0, le=1)  # 0 = off
    suppress_tokens: Optional[list[int]] = None  # token ids never generated
    response_format: Optional[ResponseFormat] = None  # structured output (mlxcel_core/constraints.py)
    user: Optional[str] = None  # accepted, ignored

    @field_validator("dry_sequence_breakers")
    @classmethod
    def _breakers(cls, value):
        if value is not None and any(b == "" for b in value):
            raise ValueError("sequence breakers must not be empty strings")
        if value is not None and len(value) > DRY_MAX_BREAKERS:
            raise ValueError(f"at most {DRY_MAX_BREAKERS} sequence breakers (got {len(value)})")
        if value is not None and any(len(b) > DRY_MAX_BREAKER_CHARS for b in value):
            raise ValueError(f"a sequence breaker has at most {DRY_MAX_BREAKER_CHARS} characters")
        return value

    @field_validator("seed")
    @classmethod
    def _seed(cls, value):
        """-1: a random seed (None), as llama.cpp; else an unsigned 64-bit integer."""
        if value == SEED_RANDOM:
            return None
        if value is not None and not 0 <= value < SEED_LIMIT:
            raise ValueError("seed must be -1 (random) or an integer in [0, 2**64 - 1]")
        return value

    def penalty(self) -> float:
        """repeat_penalty or its alias repetition_penalty (400 when both are given and differ)."""
        if (
            None not in (self.repeat_penalty, self.repetition_penalty)
            and self.repeat_penalty != self.repetition_penalty
        ):
            raise bad_request(
                "repeat_penalty and repetition_penalty are the same setting; give one "
                f"(got {self.repeat_penalty} and {self.repetition_penalty}).",
                "repeat_penalty",
            )
        value = self.repeat_penalty if self.repeat_penalty is not None else self.repetition_penalty
        return 1.0 if value is None else value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    echo: bool = False

    def single_prompt(self) -> Union[str, list[int]]:
        """One prompt: a string or token ids (a batch of exactly one is unwrapped)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise bad_request(
                    "Batched prompts are not supported: send one prompt per request (use `n` for several completions).",
                    "prompt",
                )
            prompt = prompt[0]
        if (isinstance(prompt, str) and not prompt) or (isinstance(prompt, list) and not prompt):
            raise bad_request("The prompt is empty.", "prompt")
        return prompt


_TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names
# a message's fields besides role and content that reach the chat template (reasoning: e.g. gpt-oss's analysis)
_PASSED_THROUGH = ("name", "tool_calls", "tool_call_id", "reasoning_content")


class FunctionDef(_Body):
    name: str = Field(pattern=_TOOL_NAME)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON schema; absent: no arguments
    strict: Optional[bool] = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef

    def as_template_dict(self) -> dict:
        """{"type": "function", "function": {...}} as transformers hands tools to a chat template."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # name, tool_calls, ... pass through

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[dict[str, Any]], None] = None

    def text(self, index: int) -> str:
        """The message text; content parts must all be text."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        pieces = []
        for j, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(
                    f"Only text content parts are supported (got type {part.get('type')!r}).",
                    f"messages[{index}].content[{j}]",
                )
            pieces.append(part["text"])
        return "".join(pieces)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    tools: Optional[list[Tool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool = True
    # llama.cpp's switch for reasoning models (server/reply_text.py): "none" leaves the reasoning in the content;
    # "auto" and "deepseek" (the default) return it apart as reasoning_content
    reasoning_format: Literal["none", "auto", "deepseek"] = "auto"
    chat_template_kwargs: Optional[dict[str, Any]] = None  # template variables, e.g. {"enable_thinking": false}

    def template_messages(self) -> list[dict]:
        if not self.messages:
            raise bad_request("'messages' must contain at least one message.", "messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true.", "top_logprobs")
        out = []
        for i, m in enumerate(self.messages):
            extra = {k: v for k, v in (m.model_extra or {}).items() if k in _PASSED_THROUGH}
            if extra.get("tool_calls") is not None:  # (clients send null on every assistant message)
                extra["tool_calls"] = _template_tool_calls(extra["tool_calls"], i, m.role)
            if m.role == "tool" and not isinstance(extra.get("tool_call_id"), str):
                raise bad_request("A tool message needs the 'tool_call_id' it answers.", f"messages[{i}].tool_call_id")
            role = "system" if m.role == "developer" else m.role
            out.append({"role": role, "content": m.text(i), **extra})
        return out

    def tool_mode(self) -> tuple[str, Optional[str]]:
        """("none" | "auto" | "required", None) or ("function", the name of the one function the reply must call);
        "none" whenever there are no tools."""
        choice = self.tool_choice
        if not self.tools:
            if choice not in (None, "none", "auto"):  # (clients send "auto" with an empty list)
                raise bad_request('tool_choice "required" or a named function needs tools.', "tool_choice")
            return "none", None
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in {t.function.name for t in self.tools}:
                raise bad_request(f"tool_choice names {choice.function.name!r}, which is not in tools.", "tool_choice")
            return "function", choice.function.name
        return choice or "auto", None

    def template_tools(self) -> list[dict]:
        return [t.as_template_dict() for t in self.tools or []]

    @property
    def completion_limit(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def limit_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


def _template_tool_calls(calls, index: int, role: str) -> list[dict]:
    """An assistant message's tool_calls as templates read them: each call's arguments parsed from their JSON
    string into an object (Qwen's and Llama's templates write `arguments | tojson`; vLLM does the same)."""
    param = f"messages[{index}].tool_calls"
    if role != "assistant" or not isinstance(calls, list):
        raise bad_request("tool_calls must be a list, on an assistant message.", param)
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request("Each tool call needs a function with a name.", f"{param}[{j}].function")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args or "{}")
            except json.JSONDecodeError:
                raise bad_request("The arguments are not JSON.", f"{param}[{j}].function.arguments") from None
        out.append({**call, "type": call.get("type", "function"), "function": {**fn, "arguments": args}})
    return out


class TokenizeRequest(_Body):
    content: str
    add_special: bool = False


class DetokenizeRequest(_Body):
    tokens: list[int]
