"""The per-row sampler: small pure functions over logits, applied in ONE fixed order.

     stage                                   function                              argmax-invariant
  -. grammar mask (a constrained row)        apply_allowed (masks: engine/constrained.py) no
  0. custom logits_processors (Python API)   SamplingParams.logits_processors      -
  1. logit bias, token suppression           processors.apply_logit_bias/_suppression  no
  2. repetition penalty (last n tokens)      processors.apply_repetition_penalty   no
  3. presence / frequency penalties          processors.apply_presence_frequency   no
  4. DRY                                     processors.apply_dry                  no
  5. temperature                             apply_temperature                     yes
  6. top-k                                   apply_top_k                           yes
  7. top-p                                   apply_top_p                           yes
  8. min-p                                   apply_min_p                           yes
  9. XTC (random, seeded per row)            apply_xtc                             no (drops the top choices)
 10. draw: categorical; at temperature 0 the argmax

Stages 0-4 (`RowSampler.process`) read the tokens so far; 5-10 (`RowSampler.draw`) only the logits.
A constrained row (`SamplingParams.constraint`, mlxcel_core/constraints.py) first has every token its grammar does
not allow set to -inf, so no later stage and no draw (argmax included) can pick one.
Filters (6-9) set dropped tokens to -inf and leave the survivors' logits unchanged, so the order is what
defines the result. At temperature 0 the draw is the argmax of stage 4's logits: stages 5-8 cannot
change it, and XTC, a randomization of sampling, is skipped (greedy stays deterministic).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Callable, Mapping

import mlx.core as mx

from . import processors as proc
from .constraints import Constraint
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
    # (tokens so far, logits [1, V]) -> logits; applied first, in order, before the built-in stages
    logits_processors: tuple[Callable[[list[int], mx.array], mx.array], ...] = ()
    logprobs: int | None = None  # report the chosen token's logprob and this many top alternatives
    # stage 1
    logit_bias: Mapping[int, float] | None = None  # token id -> bias in [-100, 100]
    suppress_tokens: tuple[int, ...] = ()  # never chosen
    # stage 2 (llama.cpp): over the last repeat_last_n tokens of prompt + output; -1 = all, 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    repeat_last_n: int = 64
    # stage 3 (OpenAI): over the generated tokens
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # stage 4 (koboldcpp / llama.cpp DRY)
    dry_multiplier: float = 0.0  # 0 = off
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1  # -1 = the whole context, 0 = off
    dry_sequence_breakers: tuple[str, ...] = proc.DEFAULT_DRY_SEQUENCE_BREAKERS
    # stage 9 (XTC, "exclude top choices")
    xtc_threshold: float = 0.1
    xtc_probability: float = 0.0  # 0 = off
    # structured output: a JSON schema, JSON object, regex or grammar the output must match (before stage 0)
    constraint: Constraint | None = None
    # the output text keeps special tokens (gpt-oss's harmony markers: mlxcel_core/harmony.py); EOS is never text
    skip_special_tokens: bool = True

    def __post_init__(self):
        """Each field checked against its range (InputError naming the option as the CLI spells it)."""
        self._check_sampling()
        self._check_penalties()
        self._check_dry_and_xtc()
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise InputError(f"constraint must be a Constraint, got {type(self.constraint).__name__}")

    def _check_sampling(self) -> None:
        _check(0 <= self.temperature < math.inf, "temperature", "a finite number >= 0", self.temperature)
        _check(
            self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**64),
            "seed",
            "an integer in [0, 2**64 - 1] (or none: random)",
            self.seed,
        )
        _check(_is_int(self.top_k) and self.top_k >= 0, "top-k", "an integer >= 0", self.top_k)
        _check(0.0 < self.top_p <= 1.0, "top-p", "in (0, 1]", self.top_p)
        _check(0.0 <= self.min_p <= 1.0, "min-p", "in [0, 1]", self.min_p)
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max-tokens", ">= 1", self.max_tokens)
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InputError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if any(s == "" for s in self.stop):
            raise InputError("stop strings must not be empty")
        if self.logit_bias:
            object.__setattr__(self, "logit_bias", proc.validated_logit_bias(self.logit_bias))
        object.__setattr__(self, "suppress_tokens", tuple(self.suppress_tokens))
        _check(
            all(_is_int(t) and t >= 0 for t in self.suppress_tokens),
            "suppress-tokens",
            "token ids (integers >= 0)",
            list(self.suppress_tokens),
        )

    def _check_penalties(self) -> None:
        _check(
            0 < self.repetition_penalty < math.inf,
            "repeat-penalty",
            "a finite number > 0 (1 = off)",
            self.repetition_penalty,
        )
        _check(
            _is_int(self.repeat_last_n) and self.repeat_last_n >= -1,
            "repeat-last-n",
            "an integer >= -1 (-1 = all tokens, 0 = off)",
            self.repeat_last_n,
        )
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence-penalty", "in [-2, 2]", self.presence_penalty)
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency-penalty", "in [-2, 2]", self.frequency_penalty)

    def _check_dry_and_xtc(self) -> None:
        _check(
            0 <= self.dry_multiplier < math.inf, "dry-multiplier", "a finite number >= 0 (0 = off)", self.dry_multiplier
        )
        _check(1 <= self.dry_base < math.inf, "dry-base", "a finite number >= 1", self.dry_base)
        _check(
            _is_int(self.dry_allowed_length) and self.dry_allowed_length >= 1,
            "dry-allowed-length",
            "an integer >= 1",
            self.dry_allowed_length,
        )
        _check(
            _is_int(self.dry_penalty_last_n) and self.dry_penalty_last_n >= -1,
            "dry-penalty-last-n",
            "an integer >= -1 (-1 = the whole context, 0 = off)",
            self.dry_penalty_last_n,
        )
        object.__setattr__(self, "dry_sequence_breakers", tuple(self.dry_sequence_breakers))
        _check(
            all(isinstance(b, str) and b for b in self.dry_sequence_breakers),
            "dry-sequence-breakers",
            "non-empty strings",
            list(self.dry_sequence_breakers),
        )
        breakers = self.dry_sequence_breakers
        _check(
            len(breakers) <= proc.DRY_MAX_BREAKERS and all(len(b) <= proc.DRY_MAX_BREAKER_CHARS for b in breakers),
            "dry-sequence-breakers",
            f"at most {proc.DRY_MAX_BREAKERS} strings of at most {proc.DRY_MAX_BREAKER_CHARS} characters",
            f"{len(breakers)}, the longest of {max(map(len, breakers), default=0)} characters",
        )
        _check(0.0 <= self.xtc_threshold <= 1.0, "xtc-threshold", "in [0, 1]", self.xtc_threshold)
        _check(0.0 <= self.xtc_probability <= 1.0, "xtc-probability", "in [0, 1]", self.xtc_probability)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_history(self) -> bool:
        """A stage reads the tokens so far, so the previous token must be known before this one is drawn."""
        return bool(
            self.logits_processors
            or self.repetition_penalty != 1.0
            or self.presence_penalty
            or self.frequency_penalty
            or self.dry_multiplier
        )

    @property
    def adjusts_logits(self) -> bool:
        """A mask or stages 0-4 do something (else the argmax of the model's logits is the greedy token)."""
        return self.needs_history or bool(self.logit_bias) or bool(self.suppress_tokens) or self.constraint is not None

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that needs the row on its own: rows like this share one argmax."""
        return self.greedy and not self.adjusts_logits

    @property
    def masked_greedy(self) -> bool:
        """Greedy with at most a grammar mask: the argmax of the masked logits, still shared with the batch."""
        return self.greedy and not (self.needs_history or self.logit_bias or self.suppress_tokens)

    def check_token_ids(self, vocab_size: int) -> None:
        """InputError where logit_bias or suppress-tokens names a token outside the model's vocabulary."""
        for name, ids in (("logit_bias", self.logit_bias or {}), ("suppress-tokens", self.suppress_tokens)):
            bad = next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise InputError(f"{name}: token id {bad} is outside the vocabulary (0..{vocab_size - 1})")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(ok: bool, name: str, expected: str, value) -> None:
    if not ok:  # NaN fails every comparison, so it lands here too
        raise InputError(f"{name} must be {expected}, got {value}")


def apply_allowed(logits: mx.array, allowed: mx.array) -> mx.array:
    """A constrained row's grammar mask: tokens where `allowed` (bool, broadcast to the logits) is false get -inf."""
    return mx.where(allowed, logits, mx.array(NEG_INF, logits.dtype))


# -- stages 5-9 ----------------------------------------------------------------------------------------------
def apply_temperature(logits: mx.array, temperature: float) -> mx.array:
    """Argmax-invariant for any temperature > 0."""
    return logits / temperature


def apply_top_k(logits: mx.array, k: int) -> mx.array:
    """Keep the k largest logits (ties at the boundary kept by position). Argmax-invariant."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    drop = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., k:]
    return mx.put_along_axis(logits, drop, mx.array(NEG_INF, logits.dtype), axis=-1)


def apply_top_p(logits: mx.array, p: float) -> mx.array:
    """Keep the smallest set of most likely tokens whose probability mass reaches p. Argmax-invariant."""
    if p >= 1.0:
        return logits
    order = mx.argsort(-logits, axis=-1)
    sorted_probs = mx.softmax(mx.take_along_axis(logits, order, axis=-1), axis=-1)
    mass_before = mx.cumsum(sorted_probs, axis=-1) - sorted_probs
    drop_sorted = mass_before >= p
    drop = mx.put_along_axis(mx.zeros(logits.shape, mx.bool_), order, drop_sorted, axis=-1)
    return mx.where(drop, mx.array(NEG_INF, logits.dtype), logits)


def apply_min_p(logits: mx.array, min_p: float) -> mx.array:
    """Drop tokens whose probability is below min_p times the top token's. Argmax-invariant."""
    if min_p <= 0.0:
        return logits
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    threshold = mx.max(logprobs, axis=-1, keepdims=True) + mx.log(mx.array(min_p, logprobs.dtype))
    return mx.where(logprobs < threshold, mx.array(NEG_INF, logits.dtype), logits)


def apply_xtc(logits: mx.array, threshold: float, probability: float, key: mx.array | None = None) -> mx.array:
    """XTC (koboldcpp / llama.cpp): with chance `probability`, drop every token whose probability is at
    least `threshold` except the least likely of them, when there are two or more such tokens.

    NOT argmax-invariant: its point is to remove the top choices. The chance is one uniform draw per
    row from `key` (None: every row applies it, as with probability 1). Tokens tied with the least
    likely qualifying one are all kept.
    """
    if probability <= 0.0:
        return logits
    probs = mx.softmax(logits, axis=-1)
    above = probs >= threshold
    lowest_above = mx.min(mx.where(above, probs, mx.array(math.inf, probs.dtype)), axis=-1, keepdims=True)
    drop = mx.logical_and(above, probs > lowest_above)
    drop = mx.logical_and(drop, mx.sum(above, axis=-1, keepdims=True) >= 2)
    if key is not None and probability < 1.0:
        drop = mx.logical_and(drop, mx.random.uniform(shape=(logits.shape[0], 1), key=key) < probability)
    return mx.where(drop, mx.array(NEG_INF, logits.dtype), logits)


def filtered_logits(logits: mx.array, params: SamplingParams, xtc_key: mx.array | None = None) -> mx.array:
    """The distribution the draw uses: stages 5-9 in the documented order (XTC only with `xtc_key`)."""
    logits = apply_temperature(logits.astype(mx.float32), params.temperature)
    logits = apply_top_k(logits, params.top_k)
    logits = apply_top_p(logits, params.top_p)
    logits = apply_min_p(logits, params.min_p)
    if xtc_key is not None:
        logits = apply_xtc(logits, params.xtc_threshold, params.xtc_probability, xtc_key)
    return logits


def sample(logits: mx.array, params: SamplingParams, key: mx.array | None) -> mx.array:
    """One token id per row of `logits` [B, V] (all rows share `params` and `key`): stages 5-10."""
    if params.greedy:
        return mx.argmax(logits, axis=-1)
    xtc_key = None
    if params.xtc_probability > 0.0:
        key, xtc_key = mx.random.split(key)
    return mx.random.categorical(filtered_logits(logits, params, xtc_key), axis=-1, key=key)


class RowSampler:
    """A row's sampler with its own random stream, so its draws never depend on batch neighbours.

    `prompt_len` separates prompt from generated tokens (presence / frequency count the generated ones);
    `dry_breakers` are the params' DRY sequence breakers tokenized (processors.dry_sequence_breakers).
    """

    def __init__(self, params: SamplingParams, prompt_len: int = 0, dry_breakers: proc.DryBreakers | None = None):
        self.params = params
        self.prompt_len = prompt_len
        self.dry_breakers = dry_breakers or {}
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        self._key = mx.random.key(seed)

    def process(self, logits: mx.array, tokens: list[int] | None = None, allowed: mx.array | None = None) -> mx.array:
        """Stages 0-4 for logits [1, V] given the tokens so far (prompt + generated); a constrained row's `allowed`
        tokens (bool [V], engine/constrained.py) are applied first."""
        p, tokens = self.params, tokens or []
        if allowed is not None:
            logits = apply_allowed(logits, allowed)
        for processor in p.logits_processors:
            logits = processor(tokens, logits)
        if p.logit_bias:
            logits = proc.apply_logit_bias(logits, p.logit_bias)
        if p.suppress_tokens:
            logits = proc.apply_suppression(logits, p.suppress_tokens)
        if p.repetition_penalty != 1.0:
            logits = proc.apply_repetition_penalty(logits, tokens, p.repetition_penalty, p.repeat_last_n)
        if p.presence_penalty or p.frequency_penalty:
            logits = proc.apply_presence_frequency(
                logits, tokens[self.prompt_len :], p.presence_penalty, p.frequency_penalty
            )
        if p.dry_multiplier:
            logits = proc.apply_dry(
                logits,
                tokens,
                p.dry_multiplier,
                p.dry_base,
                p.dry_allowed_length,
                p.dry_penalty_last_n,
                self.dry_breakers,
            )
        return logits

    def draw(self, logits: mx.array) -> mx.array:
        """Stages 5-10; advances the row's random stream by one draw (never at temperature 0)."""
        if self.params.greedy:
            return sample(logits, self.params, None)
        self._key, sub = mx.random.split(self._key)
        return sample(logits, self.params, sub)

    def draw_many(self, rows: mx.array) -> tuple[mx.array, list[mx.array]]:
        """Draw for each row of `rows` [n, V] as n successive `draw` calls would, without committing the
        random stream: returns (tokens [n], keys) where keys[i] is the stream after draw i. `advance(keys, m)`
        then keeps the first m draws (speculative verification uses the draws up to the first rejection)."""
        if self.params.greedy:
            return mx.argmax(rows, axis=-1), []
        tokens, keys, key = [], [], self._key
        for i in range(rows.shape[0]):
            key, sub = mx.random.split(key)
            tokens.append(sample(rows[i : i + 1], self.params, sub))
            keys.append(key)
        return mx.concatenate(tokens), keys

    def advance(self, keys: list[mx.array], used: int) -> None:
        if keys and used > 0:
            self._key = keys[used - 1]

    def __call__(self, logits: mx.array, tokens: list[int] | None = None) -> mx.array:
        return self.draw(self.process(logits, tokens))


def token_logprobs(logprobs: mx.array, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """The chosen token's log-probability, and the `top` most likely tokens with theirs (most likely first)."""
    chosen = logprobs[token].item()
    if top == 0:
        return chosen, []
    ids = mx.argpartition(-logprobs, kth=top - 1)[:top]
    values = logprobs[ids]
    order = mx.argsort(-values)
    return chosen, list(zip(ids[order].tolist(), values[order].tolist()))
