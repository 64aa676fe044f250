"""Logits processors: (tokens so far, logits [1, V]) -> logits. Applied before the sampling chain.

OpenAI's logit_bias, presence and frequency penalties, and the repetition penalty of llama.cpp /
transformers. Each is a small pure function of its arguments; `make_logits_processors` builds the
row's list from request parameters and validates them.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

import mlx.core as mx

from .errors import InputError

LogitsProcessor = Callable[[list[int], mx.array], mx.array]


def logit_bias(bias: dict[int, float]) -> LogitsProcessor:
    ids = mx.array(list(bias.keys()))
    values = mx.array(list(bias.values()), mx.float32)

    def apply(tokens: list[int], logits: mx.array) -> mx.array:
        logits = logits.astype(mx.float32)
        logits[:, ids] = logits[:, ids] + values
        return logits

    return apply


def presence_frequency_penalty(presence: float, frequency: float, prompt_len: int) -> LogitsProcessor:
    """OpenAI: logit -= presence * [count > 0] + frequency * count, over the generated tokens."""

    def apply(tokens: list[int], logits: mx.array) -> mx.array:
        counts = Counter(tokens[prompt_len:])
        if not counts:
            return logits
        ids = mx.array(list(counts.keys()))
        n = mx.array(list(counts.values()), mx.float32)
        logits = logits.astype(mx.float32)
        logits[:, ids] = logits[:, ids] - (presence + frequency * n)
        return logits

    return apply


def repetition_penalty(penalty: float, window: int | None = None) -> LogitsProcessor:
    """transformers / llama.cpp: seen tokens' positive logits are divided by `penalty`, negative ones multiplied."""

    def apply(tokens: list[int], logits: mx.array) -> mx.array:
        seen = sorted(set(tokens[-window:] if window else tokens))
        if not seen:
            return logits
        ids = mx.array(seen)
        logits = logits.astype(mx.float32)
        picked = logits[:, ids]
        logits[:, ids] = mx.where(picked > 0, picked / penalty, picked * penalty)
        return logits

    return apply


def make_logits_processors(*, vocab_size: int, prompt_len: int, logit_bias_map: dict | None = None,
                           presence: float = 0.0, frequency: float = 0.0, repetition: float = 1.0,
                           repetition_window: int | None = None) -> tuple[LogitsProcessor, ...]:
    """Validated processors for one request, in a fixed order: bias, repetition, presence/frequency."""
    processors: list[LogitsProcessor] = []
    if logit_bias_map:
        bias = {}
        for key, value in logit_bias_map.items():
            try:
                token = int(key)
            except (TypeError, ValueError):
                raise InputError(f"logit_bias key {key!r} is not a token id") from None
            if not 0 <= token < vocab_size:
                raise InputError(f"logit_bias token id {token} is outside the vocabulary (0..{vocab_size - 1})")
            if not isinstance(value, (int, float)) or not -100 <= value <= 100:
                raise InputError(f"logit_bias value for token {token} must be a number in [-100, 100]")
            bias[token] = float(value)
        processors.append(logit_bias(bias))
    if not 0 < repetition:
        raise InputError(f"repetition_penalty must be > 0, got {repetition}")
    if repetition != 1.0:
        processors.append(repetition_penalty(repetition, repetition_window))
    for name, value in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if not -2.0 <= value <= 2.0:
            raise InputError(f"{name} must be in [-2, 2], got {value}")
    if presence or frequency:
        processors.append(presence_frequency_penalty(presence, frequency, prompt_len))
    return tuple(processors)
