"""`--reasoning show|hide` on generate and run: a reasoning model's reply printed with its reasoning set apart.

For a model whose chat template teaches reasoning (mlxcel_core/reasoning.py: `<think>` tags, or gpt-oss's harmony
channels), the reply is split as it streams. `show` (the default) prints the reasoning between a `<think>` line and
a `</think>` line, then the answer: what Qwen3 or DeepSeek-R1 write, and the same form for gpt-oss's analysis.
`hide` prints the answer alone. `--json`'s "text" is the answer, and with `show` "reasoning" the reasoning (null
when the reply has none). Not split: a prompt sent without the chat template, and output constrained by
--json-schema / --regex / --grammar (the grammar covers the whole reply). No MLX here.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from .errors import fail

MODES = ("show", "hide")


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise fail(f"--reasoning must be show or hide, got '{mode}'")
    return mode


class ReasoningView:
    """Streams a reply to `write`, its reasoning set apart (or left out); `answer` / `reasoning` hold the whole.
    `split`: the reply's reasoning.SplitStream, None when there is nothing to split."""

    def __init__(self, split, mode: str, write: Callable | None):
        self.split, self.show, self.write = split, mode == "show", write or (lambda text: None)
        self.answer, self.reasoning, self._open = "", None, False

    @classmethod
    def for_prompt(cls, tokenizer, prompt_ids: list[int], params, chat_template: bool, mode: str, write):
        """generate's view, and its SamplingParams: harmony's markers are special tokens, kept in the text."""
        from mlxcel_core.reasoning import detect, opens_inside, reply_stream

        kind = detect(tokenizer.chat_template) if chat_template and params.constraint is None else None
        view = cls(reply_stream(kind, kind == "think" and opens_inside(tokenizer, prompt_ids)), mode, write)
        return view, dataclasses.replace(params, skip_special_tokens=False) if kind == "harmony" else params

    def feed(self, piece: str) -> None:
        self._out(*(self.split.feed(piece) if self.split else ("", piece)))

    def finish(self) -> None:
        if self.split:
            self._out(*self.split.finish())
        if self._open:  # the reply ended inside its reasoning
            self.write("\n</think>\n\n")
            self._open = False

    def _out(self, reasoning: str, answer: str) -> None:
        if reasoning:
            self.reasoning = (self.reasoning or "") + reasoning
            if self.show:
                self.write(("" if self._open else "<think>\n") + reasoning)
                self._open = True
        if answer:
            if self._open:
                self.write("\n</think>\n\n")
                self._open = False
            self.answer += answer
            self.write(answer)
