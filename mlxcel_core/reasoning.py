"""A reasoning model's reply split into its reasoning and its answer, whole or as it streams.

Two formats, told apart by the chat template's text (as server/tool_calls.py tells call formats apart):
    think    `<think> ... </think>` then the answer (Qwen3, QwQ, DeepSeek-R1, SmolLM3, GLM-4.5 ...). A template may
             open `<think>` in the prompt itself (DeepSeek-R1, Qwen3 thinking-2507): the reply then starts inside
             the reasoning, and everything up to `</think>` is reasoning.
    harmony  gpt-oss's channels (mlxcel_core/harmony.py): `analysis` is the reasoning, `final` the answer.
A think reply that does not start with `<think>` (and was not opened in the prompt) is all answer; one cut short
before `</think>` is all reasoning. The reasoning is stripped of surrounding whitespace, the answer of leading
whitespace. No MLX here.
"""

from __future__ import annotations

from typing import Callable

THINK_START, THINK_END = "<think>", "</think>"
PROMPT_TAIL_TOKENS = 8  # prompt tokens looked at for an opened `<think>`

Split = tuple[str | None, str]  # (reasoning, or None when the reply has none; the answer)


def detect(template: str | None) -> str | None:
    """ "harmony", "think", or None: the reasoning format a chat template teaches its model."""
    template = template or ""
    if "<|channel|>" in template:
        return "harmony"
    if THINK_END in template:
        return "think"
    return None


def opens_inside(tokenizer, prompt_ids: list[int]) -> bool:
    """Whether the rendered prompt ends inside an opened `<think>` (the reply then starts in its reasoning)."""
    tail = tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    return tail.rstrip().endswith(THINK_START)


def keeps_special_tokens(tokenizer, kind: str | None) -> bool:
    """Whether the reply must be decoded with its special tokens for `kind` to be split: always for harmony (its
    markers are special tokens), for think only where the tokenizer marks `<think>` / `</think>` special."""
    if kind == "harmony":
        return True
    if kind != "think":
        return False
    added = tokenizer.backend.get_added_tokens_decoder().values()
    return any(t.special and t.content in (THINK_START, THINK_END) for t in added)


def split_think(text: str, inside: bool, partial: bool = False) -> Split:
    """A think reply's (reasoning, answer). `inside`: the prompt opened `<think>`. `partial`: the text so far of a
    streamed reply, where leading whitespace may still turn out to be before `<think>` (then nothing is decided)."""
    if not inside:
        lead = text.lstrip()
        if partial and not lead:
            return None, ""
        if not lead.startswith(THINK_START):
            return None, text
        text = lead[len(THINK_START) :]
    end = text.find(THINK_END)
    if end < 0:
        return text.strip(), ""
    return text[:end].strip(), text[end + len(THINK_END) :].lstrip()


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """Where the text's end may be the beginning of one of `markers`: the length of the text safe to read."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:k]):
                best = max(best, k)
                break
    return len(text) - best


class SplitStream:
    """A streamed reply split as it comes: `feed` returns (reasoning delta, answer delta); with `finish`'s, the
    deltas add up to `split(whole text)`. `split(text, partial)` must only ever extend what it returned for a
    prefix of the text, the end of which is held back while it may be the beginning of one of `markers`."""

    def __init__(self, split: Callable[[str, bool], Split], markers: tuple[str, ...]):
        self.split, self.markers = split, markers
        self.text, self.reasoning, self.answer = "", "", ""

    def feed(self, piece: str) -> tuple[str, str]:
        self.text += piece
        return self._delta(self.split(self.text[: held_back(self.text, self.markers)], True))

    def finish(self) -> tuple[str, str]:
        return self._delta(self.split(self.text, False))

    def _delta(self, parts: Split) -> tuple[str, str]:
        reasoning, answer = parts[0] or "", parts[1]
        out = []
        for attr, now in (("reasoning", reasoning), ("answer", answer)):
            sent = getattr(self, attr)
            if now.startswith(sent) and len(now) > len(sent):
                out.append(now[len(sent) :])
                setattr(self, attr, now)
            else:  # nothing new (never taken back)
                out.append("")
        return out[0], out[1]


def think_stream(inside: bool) -> SplitStream:
    return SplitStream(lambda text, partial: split_think(text, inside, partial), (THINK_START, THINK_END))


def reply_stream(kind: str | None, inside: bool = False) -> SplitStream | None:
    """The streamed split of a reply in `kind`'s format (harmony: messages to tools read as answer); None for none."""
    if kind == "think":
        return think_stream(inside)
    if kind != "harmony":
        return None
    from . import harmony

    def parts(text: str, partial: bool) -> Split:
        reply = harmony.split(text, partial, calls=False)
        return reply.reasoning, reply.content

    return SplitStream(parts, harmony.MARKERS)
