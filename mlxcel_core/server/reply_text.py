"""A chat choice's text as OpenAI shapes it: reasoning_content, content and tool_calls, whole or streamed.

`plan_text` decides once a request (a TextPlan): the reasoning format the chat template teaches
(mlxcel_core/reasoning.py: `<think>` tags or gpt-oss harmony), whether the prompt opened the reasoning, the tool-call
family (server/tool_calls.py) and parallel_tool_calls. The reasoning is split off first and tool calls are parsed
from the answer only (harmony: from its messages to `functions.NAME`). Nothing is split off when the request says
`reasoning_format: "none"` (llama.cpp's spelling: the reply as generated is the content; harmony keeps its special
tokens there) or when a grammar covers the whole reply (response_format; a forced call, except harmony's, whose
grammar lets the analysis come first).
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import harmony
from ..reasoning import SplitStream, detect, keeps_special_tokens, opens_inside, split_think, think_stream
from .tool_calls import StreamSplitter, ToolCall, parse


@dataclass(frozen=True)
class TextPlan:
    reasoning: str | None = None  # "think" or "harmony": split so; None: no split
    inside: bool = False  # think: the prompt opened `<think>`
    tool_family: str | None = None  # parse calls so (None: no tools)
    parallel: bool = True
    harmony: bool = False  # the reply is harmony (calls read from it even when not split)
    keep_special: bool = False  # decode the reply with its special tokens (SamplingParams.skip_special_tokens)


def plan_text(body, tokenizer, prompt_ids: list[int], tool_family: str | None, tool_constraint) -> TextPlan:
    """The plan of a chat request (schemas.ChatCompletionRequest) whose prompt is `prompt_ids`; `tool_constraint`:
    the grammar of a forced call (plan_tools), if any."""
    kind = detect(tokenizer.chat_template)
    is_harmony = kind == "harmony"
    constrained = (body.response_format is not None and body.response_format.type != "text") or (
        tool_constraint is not None and not is_harmony
    )
    split = None if constrained or body.reasoning_format == "none" else kind
    return TextPlan(
        reasoning=split,
        inside=split == "think" and opens_inside(tokenizer, prompt_ids),
        tool_family=tool_family,
        parallel=body.parallel_tool_calls,
        harmony=is_harmony,
        keep_special=keeps_special_tokens(tokenizer, kind if is_harmony else split),
    )


def _harmony(plan: TextPlan, text: str, partial: bool = False) -> harmony.Reply:
    return harmony.split(text, partial, raw=plan.reasoning is None, calls=plan.tool_family is not None)


def whole(plan: TextPlan, text: str) -> tuple[str | None, str, list[ToolCall]]:
    """A whole reply's (reasoning or None, content, calls)."""
    if plan.harmony:
        reply = _harmony(plan, text)
        calls = [ToolCall(name, args) for name, args in reply.calls]
        return reply.reasoning, reply.content, calls if plan.parallel else calls[:1]
    reasoning, content = split_think(text, plan.inside) if plan.reasoning == "think" else (None, text)
    calls = []
    if plan.tool_family:
        calls, content = parse(plan.tool_family, content, plan.parallel)
    return reasoning, content, calls


class TextStream:
    """A streamed reply: `feed` returns (reasoning delta, content delta); `finish` the last ones and the calls.
    Content from where a call may begin is held back (tool_calls.StreamSplitter); the deltas add up to `whole`."""

    def __init__(self, plan: TextPlan):
        self.plan = plan
        self.split: SplitStream | None = None
        if plan.harmony:
            self.split = SplitStream(lambda text, partial: _parts(_harmony(plan, text, partial)), harmony.MARKERS)
        elif plan.reasoning == "think":
            self.split = think_stream(plan.inside)
        self.tools = StreamSplitter(plan.tool_family, plan.parallel) if plan.tool_family and not plan.harmony else None

    def feed(self, piece: str) -> tuple[str, str]:
        reasoning, content = self.split.feed(piece) if self.split else ("", piece)
        return reasoning, self.tools.feed(content) if self.tools else content

    def finish(self) -> tuple[str, str, list[ToolCall]]:
        reasoning, content = self.split.finish() if self.split else ("", "")
        calls = []
        if self.tools:
            content = self.tools.feed(content)
            calls, rest = self.tools.finish()
            content += rest if rest.strip() or not calls else ""  # (whitespace between calls is no content)
        elif self.plan.harmony and self.plan.tool_family:
            calls = whole(self.plan, self.split.text)[2]
        return reasoning, content, calls


def _parts(reply: harmony.Reply) -> tuple[str | None, str]:
    return reply.reasoning, reply.content
