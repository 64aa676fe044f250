"""Sampling as small pure functions over logits, applied in one fixed order:

    temperature -> top-k -> top-p -> min-p -> categorical draw   (temperature 0: argmax)

Each filter masks tokens to -inf and leaves the survivors' logits unchanged, so the order is
what defines the result. All filters are argmax-invariant (the most likely token always survives),
which is why temperature 0 can skip them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

from .errors import InputError

NEG_INF = float("-inf")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = field(default_factory=tuple)
    # (tokens so far, logits [1, V]) -> logits; applied first, in order (e.g. penalties, logit bias)
    logits_processors: tuple[Callable[[list[int], mx.array], mx.array], ...] = ()
    logprobs: int | None = None  # report the chosen token's logprob and this many top alternatives

    def __post_init__(self):
        if not 0 <= self.temperature < float("inf"):  # also rejects NaN
            raise InputError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InputError(f"top-k must be an integer >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InputError(f"top-p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InputError(f"min-p must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 1:
            raise InputError(f"max-tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InputError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if any(s == "" for s in self.stop):
            raise InputError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that needs the row on its own: rows like this share one argmax."""
        return self.greedy and not self.logits_processors


def apply_temperature(logits: mx.array, temperature: float) -> mx.array:
    return logits / temperature


def apply_top_k(logits: mx.array, k: int) -> mx.array:
    """Keep the k largest logits (ties at the boundary kept by position)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    drop = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., k:]
    return mx.put_along_axis(logits, drop, mx.array(NEG_INF, logits.dtype), axis=-1)


def apply_top_p(logits: mx.array, p: float) -> mx.array:
    """Keep the smallest set of most likely tokens whose probability mass reaches p."""
    if p >= 1.0:
        return logits
    order = mx.argsort(-logits, axis=-1)
    sorted_probs = mx.softmax(mx.take_along_axis(logits, order, axis=-1), axis=-1)
    mass_before = mx.cumsum(sorted_probs, axis=-1) - sorted_probs
    drop_sorted = mass_before >= p
    drop = mx.put_along_axis(mx.zeros(logits.shape, mx.bool_), order, drop_sorted, axis=-1)
    return mx.where(drop, mx.array(NEG_INF, logits.dtype), logits)


def apply_min_p(logits: mx.array, min_p: float) -> mx.array:
    """Drop tokens whose probability is below min_p times the top token's."""
    if min_p <= 0.0:
        return logits
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    threshold = mx.max(logprobs, axis=-1, keepdims=True) + mx.log(mx.array(min_p, logprobs.dtype))
    return mx.where(logprobs < threshold, mx.array(NEG_INF, logits.dtype), logits)


def filtered_logits(logits: mx.array, params: SamplingParams) -> mx.array:
    """The distribution the draw uses, after every filter in the documented order."""
    logits = apply_temperature(logits.astype(mx.float32), params.temperature)
    logits = apply_top_k(logits, params.top_k)
    logits = apply_top_p(logits, params.top_p)
    return apply_min_p(logits, params.min_p)


def sample(logits: mx.array, params: SamplingParams, key: mx.array | None) -> mx.array:
    """One token id per row of `logits` [B, V] (all rows share `params`)."""
    if params.greedy:
        return mx.argmax(logits, axis=-1)
    return mx.random.categorical(filtered_logits(logits, params), axis=-1, key=key)


class RowSampler:
    """A row's sampler with its own random stream, so its draws never depend on batch neighbours."""

    def __init__(self, params: SamplingParams):
        self.params = params
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        self._key = mx.random.key(seed)

    def process(self, logits: mx.array, tokens: list[int] | None = None) -> mx.array:
        """Apply the row's logits processors (penalties, biases, ...) in order."""
        for processor in self.params.logits_processors:
            logits = processor(tokens or [], logits)
        return logits

    def draw(self, logits: mx.array) -> mx.array:
        if self.params.greedy:
            return sample(logits, self.params, None)
        self._key, sub = mx.random.split(self._key)
        return sample(logits, self.params, sub)

    def __call__(self, logits: mx.array, tokens: list[int] | None = None) -> mx.array:
        return self.draw(self.process(logits, tokens))
