"""The history-dependent (and bias) stages of the sampler: small pure functions of (logits, tokens, knobs).

They run before the sampling chain of `sampling.py`, in this order (see sampling.py for the whole pipeline):

    logit bias + token suppression -> repetition penalty -> presence / frequency penalties -> DRY

None of them is argmax-invariant: each exists to change which token is most likely. Each takes logits
[B, V] (every row gets the same adjustment) and returns float32 logits. The token lists are host lists
(prompt + generated tokens), so the functions that read them run on the host and touch only the
columns they change.

The `make_logits_processors` / `logit_bias` / ... factories wrap the same functions as
`(tokens, logits) -> logits` callables for code that builds `SamplingParams.logits_processors` itself.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Callable, Iterable, Mapping, Sequence

import mlx.core as mx

from .errors import InputError

LogitsProcessor = Callable[[list[int], mx.array], mx.array]
NEG_INF = float("-inf")

# llama.cpp's defaults and limits for DRY sequence breakers (common/common.h, llama-sampling.cpp); the count
# limit is mlxcel's: each breaker costs a scan of the vocabulary (engine/dry_cache.py)
DEFAULT_DRY_SEQUENCE_BREAKERS = ("\n", ":", '"', "*")
DRY_MAX_BREAKERS = 16
DRY_MAX_BREAKER_CHARS = 40
DRY_MAX_BREAKER_TAIL_TOKENS = 20
_FLOAT_MAX_LOG = 88.7228391  # log(float32 max): DRY's exponent is clamped so base ** exponent stays finite

# DRY breakers after tokenization: head token -> the token tails that complete a breaker after it
# (an empty tail: the head token alone contains a whole breaker).
DryBreakers = Mapping[int, Sequence[tuple[int, ...]]]


# -- 1. logit bias and token suppression ---------------------------------------------------------------
def apply_logit_bias(logits: mx.array, bias: Mapping[int, float]) -> mx.array:
    """OpenAI's logit_bias: add bias[token] to that token's logit."""
    logits = logits.astype(mx.float32)
    if not bias:
        return logits
    ids = mx.array(list(bias.keys()))
    logits[:, ids] = logits[:, ids] + mx.array(list(bias.values()), mx.float32)
    return logits


def apply_suppression(logits: mx.array, tokens: Iterable[int]) -> mx.array:
    """The listed tokens can never be chosen (logit -inf)."""
    logits = logits.astype(mx.float32)
    ids = sorted(set(tokens))
    if ids:
        logits[:, mx.array(ids)] = NEG_INF
    return logits


# -- 2. repetition penalty ------------------------------------------------------------------------------
def penalty_window(tokens: Sequence[int], last_n: int) -> Sequence[int]:
    """The last `last_n` tokens (llama.cpp's convention: -1 = all of them, 0 = none)."""
    if last_n < 0:
        return tokens
    return tokens[len(tokens) - last_n :] if last_n else ()


def apply_repetition_penalty(logits: mx.array, tokens: Sequence[int], penalty: float, last_n: int = 64) -> mx.array:
    """llama.cpp / transformers (CTRL): every token seen in the window has its logit divided by `penalty`
    when positive and multiplied by it when negative. 1 = off."""
    logits = logits.astype(mx.float32)
    seen = sorted(set(penalty_window(tokens, last_n)))
    if penalty == 1.0 or not seen:
        return logits
    ids = mx.array(seen)
    picked = logits[:, ids]
    logits[:, ids] = mx.where(picked > 0, picked / penalty, picked * penalty)
    return logits


# -- 3. presence / frequency penalties --------------------------------------------------------------------
def apply_presence_frequency(logits: mx.array, generated: Sequence[int], presence: float, frequency: float) -> mx.array:
    """OpenAI: logit -= presence * [count > 0] + frequency * count, counting the generated tokens only."""
    logits = logits.astype(mx.float32)
    counts = Counter(generated)
    if not counts or (presence == 0.0 and frequency == 0.0):
        return logits
    ids = mx.array(list(counts.keys()))
    n = mx.array(list(counts.values()), mx.float32)
    logits[:, ids] = logits[:, ids] - (presence + frequency * n)
    return logits


# -- 4. DRY ("Don't Repeat Yourself", koboldcpp / llama.cpp) ---------------------------------------------------
def dry_penalties(
    tokens: Sequence[int], multiplier: float, base: float, allowed_length: int, last_n: int, breakers: DryBreakers
) -> dict[int, float]:
    """token -> how much DRY subtracts from its logit, following llama.cpp's `llama_sampler_dry_apply`.

    A token that would extend a repeat of the context's last `n` tokens (n >= allowed_length: the same n
    tokens occur earlier, followed by this token) is penalized multiplier * base ** (n - allowed_length),
    n being the longest such repeat. Only the last `last_n` tokens are looked at (-1: all, 0: off). A
    repeat never reaches back over a sequence breaker: the most recent breaker in the window limits n to
    the tokens after it, and a token that is itself a whole breaker is never penalized.
    """
    if multiplier == 0.0 or base < 1.0 or last_n == 0:
        return {}
    window = list(penalty_window(tokens, last_n))
    n = len(window)
    if n <= allowed_length:
        return {}
    rep_limit = _dry_repeat_limit(window, breakers)
    if rep_limit < allowed_length:
        return {}
    # z[k]: how many of the window's last tokens are repeated by the tokens ending k positions earlier
    z = _z_function(window[::-1])
    longest: dict[int, int] = {}
    for k in range(1, n):
        length = min(z[k], rep_limit)
        if length >= allowed_length:
            token = window[n - k]  # what followed that earlier occurrence: emitting it extends the repeat
            longest[token] = max(longest.get(token, 0), length)
    max_exponent = int(_FLOAT_MAX_LOG / math.log(base)) if base > 1.000001 else 0
    penalties = {}
    for token, length in longest.items():
        if any(len(tail) == 0 for tail in breakers.get(token, ())):
            continue  # a single-token sequence breaker is never penalized
        exponent = length - allowed_length
        if max_exponent > 0:
            exponent = min(exponent, max_exponent)
        penalties[token] = multiplier * base**exponent
    return penalties


def apply_dry(
    logits: mx.array,
    tokens: Sequence[int],
    multiplier: float,
    base: float,
    allowed_length: int,
    last_n: int,
    breakers: DryBreakers,
) -> mx.array:
    logits = logits.astype(mx.float32)
    penalties = dry_penalties(tokens, multiplier, base, allowed_length, last_n, breakers)
    if penalties:
        ids = mx.array(list(penalties.keys()))
        logits[:, ids] = logits[:, ids] - mx.array(list(penalties.values()), mx.float32)
    return logits


def _dry_repeat_limit(window: list[int], breakers: DryBreakers) -> int:
    """Tokens after the most recent complete sequence breaker (the whole window when there is none)."""
    n = len(window)
    for i in range(n):  # i tokens from the end: a breaker's head token
        tails = breakers.get(window[n - 1 - i])
        if not tails:
            continue
        longest = -1
        for tail in tails:
            if longest < len(tail) <= i and all(t == window[n - i + j] for j, t in enumerate(tail)):
                longest = len(tail)
        if longest >= 0:
            return i - longest
    return n


def _z_function(s: list[int]) -> list[int]:
    """z[k] = length of the longest common prefix of s and s[k:] (z[0] = 0), in linear time."""
    n = len(s)
    z = [0] * n
    left = right = 0
    for k in range(1, n):
        if k < right:
            z[k] = min(right - k, z[k - left])
        while k + z[k] < n and s[z[k]] == s[k + z[k]]:
            z[k] += 1
        if k + z[k] > right:
            left, right = k, k + z[k]
    return z


def dry_sequence_breakers(
    vocab: Sequence[str], encode: Callable[[str], list[int]], breakers: Iterable[str]
) -> dict[int, list[tuple[int, ...]]]:
    """Breaker strings -> head token -> tails, as llama.cpp's `get_overlapping_token_sequences`.

    `vocab[i]` is token i's text. A token containing a whole breaker is a head with an empty tail; a token
    whose text ends with the start of a breaker is a head whose tail is the tokenization of the rest of
    the breaker (at most 20 tokens). Breakers are cut to 40 characters.
    """
    heads: dict[int, list[tuple[int, ...]]] = {}
    for breaker in breakers:
        breaker = breaker[:DRY_MAX_BREAKER_CHARS]
        if not breaker:
            continue
        tails_of: dict[str, tuple[int, ...]] = {}
        for token, word in enumerate(vocab):
            if breaker in word:
                tails = [()]
            else:
                tails = []
                pos = word.find(breaker[0])
                while pos != -1:
                    overlap = len(word) - pos  # the word ends with breaker[:overlap] (< len(breaker))
                    if breaker.startswith(word[pos:]):
                        rest = breaker[overlap:]
                        if rest not in tails_of:
                            tails_of[rest] = tuple(encode(rest)[:DRY_MAX_BREAKER_TAIL_TOKENS])
                        tails.append(tails_of[rest])
                    pos = word.find(breaker[0], pos + 1)
            known = heads.setdefault(token, [])
            known.extend(t for t in tails if t not in known)
        heads = {t: v for t, v in heads.items() if v}
    return heads


# -- factories: the same stages as (tokens, logits) -> logits callables --------------------------------------
def logit_bias(bias: dict[int, float]) -> LogitsProcessor:
    return lambda tokens, logits: apply_logit_bias(logits, bias)


def presence_frequency_penalty(presence: float, frequency: float, prompt_len: int) -> LogitsProcessor:
    return lambda tokens, logits: apply_presence_frequency(logits, tokens[prompt_len:], presence, frequency)


def repetition_penalty(penalty: float, window: int | None = None) -> LogitsProcessor:
    return lambda tokens, logits: apply_repetition_penalty(logits, tokens, penalty, -1 if window is None else window)


def make_logits_processors(
    *,
    vocab_size: int,
    prompt_len: int,
    logit_bias_map: dict | None = None,
    presence: float = 0.0,
    frequency: float = 0.0,
    repetition: float = 1.0,
    repetition_window: int | None = None,
) -> tuple[LogitsProcessor, ...]:
    """Validated processors for one request, in the pipeline's order: bias, repetition, presence/frequency."""
    processors: list[LogitsProcessor] = []
    if logit_bias_map:
        processors.append(logit_bias(validated_logit_bias(logit_bias_map, vocab_size)))
    if not 0 < repetition < math.inf:
        raise InputError(f"repetition_penalty must be > 0, got {repetition}")
    if repetition != 1.0:
        processors.append(repetition_penalty(repetition, repetition_window))
    for name, value in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if not -2.0 <= value <= 2.0:
            raise InputError(f"{name} must be in [-2, 2], got {value}")
    if presence or frequency:
        processors.append(presence_frequency_penalty(presence, frequency, prompt_len))
    return tuple(processors)


def validated_logit_bias(bias_map: Mapping, vocab_size: int | None = None) -> dict[int, float]:
    """{token id (int or numeric string): bias in [-100, 100]} -> {int: float}; InputError otherwise."""
    bias = {}
    for key, value in bias_map.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise InputError(f"logit_bias key {key!r} is not a token id") from None
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            upper = f" (0..{vocab_size - 1})" if vocab_size is not None else ""
            raise InputError(f"logit_bias token id {token} is outside the vocabulary{upper}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise InputError(f"logit_bias value for token {token} must be a number in [-100, 100], got {value!r}")
        bias[token] = float(value)
    return bias
