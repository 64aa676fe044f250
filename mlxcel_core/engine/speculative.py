"""Speculative decoding: a drafter proposes up to k tokens, the target model checks them in one forward.

One round for a decoding sequence whose tokens so far are `history` (the last one not yet in the KV cache):

1. the drafter proposes d_1..d_k (prompt lookup: what followed the latest earlier occurrence of the
   sequence's last n tokens; or a small draft model's greedy continuation);
2. the target scores [history[-1], d_1..d_k] in one forward: row i of the logits predicts the token after
   d_i (d_0 = history[-1]);
3. the row's own sampler (every stage of sampling.py, with the history extended by the draft tokens before
   it) draws a token from each row, in order, from the row's random stream; the draft is accepted while the
   draw equals the proposal, and the first draw that differs is emitted instead (the target's own token).
   With no mismatch the draw after d_k is emitted too. So each round emits accepted + 1 tokens, exactly the
   tokens the sampler would have drawn one step at a time from the same logits: at temperature 0 the output
   is the greedy output, and a seeded sampled output is the same sequence too;
4. the rejected draft positions are dropped from the target's KV cache (dense: columns; paged: the
   sequence's length) and from the draft model's cache. A recurrent state (qwen3_5, qwen3_next, lfm2, nemotron_h:
   target or draft) goes back to a checkpoint instead (recurrent_rollback.py).

Only a sequence that decodes alone speculates (the engine falls back to plain decoding while it batches):
rows accepting different counts would break the dense batch's shared column axis.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import mlx.core as mx
import numpy as np

from ..cache import KVCache, make_cache
from ..errors import InputError
from ..models.base import has_recurrent_layers
from ..sampling import RowSampler
from .constrained import allowed as unpack_allowed
from .recurrent_rollback import CacheCheckpoint, checkpoint, restore
from .types import SpecStats, SpeculativeConfig


class Drafter(Protocol):
    def propose(self, seq_id: int, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens likely to follow `tokens` (the sequence so far); [] when it has no guess."""

    def rollback(self, seq_id: int, length: int) -> None:
        """Only the first `length` tokens of the sequence are known to be right from now on."""

    def free(self, seq_id: int) -> None: ...


class PromptLookupDrafter:
    """Prompt lookup (n-gram) drafting: find the sequence's last n tokens earlier in the sequence (prompt
    included), n from `max_ngram` down to 1, and propose what followed them. The latest occurrence that
    still has k tokens after it wins (else the earliest: it has the most). No model, no state."""

    def __init__(self, max_ngram: int):
        self.max_ngram = max_ngram

    def propose(self, seq_id: int, tokens: list[int], k: int) -> list[int]:
        return ngram_proposal(tokens, self.max_ngram, k)

    def rollback(self, seq_id: int, length: int) -> None:
        pass

    def free(self, seq_id: int) -> None:
        pass


def ngram_proposal(tokens: list[int], max_ngram: int, k: int) -> list[int]:
    n_tokens = len(tokens)
    if n_tokens < 2 or k < 1:
        return []
    seq = np.asarray(tokens)
    for n in range(min(max_ngram, n_tokens - 1), 0, -1):
        # windows starting at i cover tokens i..i+n-1; all of them are followed by at least one token
        windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
        starts = np.flatnonzero((windows == seq[-n:]).all(axis=1))
        if starts.size:
            follows = starts + n  # where the continuation of each match begins
            full = follows[follows <= n_tokens - k]
            begin = int(full[-1]) if full.size else int(follows[0])
            return tokens[begin : begin + k]
    return []


@dataclass
class _DraftState:
    caches: list[KVCache]
    length: int = 0  # tokens of the sequence in the draft model's cache
    # A recurrent draft model's caches after each of the last draft's forwards, by the length they held.
    saved: dict[int, CacheCheckpoint] = field(default_factory=dict)


class DraftModelDrafter:
    """A smaller model with the same tokenizer proposes its greedy continuation.

    Its own dense KV cache follows each sequence: before drafting it takes in the tokens it has not seen
    (the prompt the first time, in chunks; then the last emitted tokens), and after verification it is
    cut back to the accepted tokens. A draft model with recurrent layers keeps its caches after each draft forward
    and goes back to the one at the accepted length (recurrent_rollback.py).
    """

    def __init__(self, model, prefill_chunk_size: int = 2048):
        self.model = model
        self.prefill_chunk_size = prefill_chunk_size
        self.max_context = model.max_context_length
        self.recurrent = has_recurrent_layers(model)
        self._states: dict[int, _DraftState] = {}

    def propose(self, seq_id: int, tokens: list[int], k: int) -> list[int]:
        k = min(k, self.max_context - len(tokens))
        if k < 1:
            return []
        state = self._states.get(seq_id)
        if state is None:
            state = self._states[seq_id] = _DraftState(make_cache(len(self.model.layers)))
        pending = tokens[state.length :]
        body, last = pending[:-1], pending[-1:]
        for start in range(0, len(body), self.prefill_chunk_size):
            self.model(mx.array([body[start : start + self.prefill_chunk_size]]), state.caches)
            mx.eval([c.state for c in state.caches])
        token = mx.argmax(self.model(mx.array([last]), state.caches)[:, -1, :], axis=-1)
        draft = [token]
        state.saved = {len(tokens): checkpoint(state.caches)} if self.recurrent else {}
        for i in range(k - 1):  # lazy: one evaluation for the whole draft
            token = mx.argmax(self.model(token[:, None], state.caches)[:, -1, :], axis=-1)
            draft.append(token)
            if self.recurrent:
                state.saved[len(tokens) + i + 1] = checkpoint(state.caches)
        state.length = len(tokens) + k - 1  # the last draft token was never fed back
        return mx.concatenate(draft).tolist()

    def rollback(self, seq_id: int, length: int) -> None:
        state = self._states.get(seq_id)
        if state is not None and length < state.length:
            state.length = length
            if self.recurrent:
                restore(state.caches, state.saved[length])
            else:
                for layer in state.caches:
                    layer.trim(length)

    def free(self, seq_id: int) -> None:
        self._states.pop(seq_id, None)


def check_same_vocabulary(target_tokenizer, draft_tokenizer, draft_name: str) -> None:
    """A draft model must share the target's tokenizer: the same token for every id."""
    target, draft = target_tokenizer.backend.get_vocab(), draft_tokenizer.backend.get_vocab()
    if target == draft:
        return
    if len(target) != len(draft):
        detail = f"{len(draft)} tokens, the target has {len(target)}"
    else:
        token = next(t for t in sorted(target, key=target.get) if draft.get(t) != target[t])
        detail = f"token {token!r} is id {target[token]} in the target but {draft.get(token)} in the draft"
    raise InputError(
        f"draft model {draft_name} has a different vocabulary ({detail}); speculative decoding "
        f"needs a draft model with the same tokenizer as the target"
    )


def make_drafter(config: SpeculativeConfig, target_tokenizer, prefill_chunk_size: int, draft=None) -> Drafter:
    """The configured drafter. `draft`: an already loaded draft model (LoadedModel), else it is loaded here."""
    if config.ngram:
        return PromptLookupDrafter(config.ngram)
    if draft is None:
        from ..loading import load_model

        draft = load_model(config.draft_model, log=lambda message: None)
    check_same_vocabulary(target_tokenizer, draft.tokenizer, config.draft_model)
    return DraftModelDrafter(draft.model, prefill_chunk_size)


@dataclass
class Verdict:
    tokens: list[int]  # accepted draft tokens, then the target's own token
    nan: bool


def verify(sampler: RowSampler, logits: mx.array, proposals: list[int], history: list[int], constraint=None) -> Verdict:
    """Accept draft tokens while the row's sampler draws them from the target's logits [k + 1, V].

    A constrained row (`constraint`, a constrained.RowConstraint) masks each position with what its grammar allows
    after the draft tokens before it: a draft token the grammar refuses is never accepted."""
    rows = logits
    allowed = [None] * (len(proposals) + 1)
    if constraint is not None:
        allowed = unpack_allowed(constraint.draft_masks(proposals), logits.shape[-1])
    if sampler.params.adjusts_logits:  # every stage sees the history the token would really have
        rows = mx.concatenate(
            [sampler.process(logits[i : i + 1], history + proposals[:i], allowed[i]) for i in range(len(proposals) + 1)]
        )
    drawn, keys = sampler.draw_many(rows)
    nan = mx.isnan(rows).any(axis=-1)
    mx.eval(drawn, nan)
    drawn, nan = drawn.tolist(), nan.tolist()
    accepted = 0
    while accepted < len(proposals) and drawn[accepted] == proposals[accepted]:
        accepted += 1
    sampler.advance(keys, accepted + 1)  # the random stream moves on by exactly the draws kept
    return Verdict(drawn[: accepted + 1], any(nan[: accepted + 1]))


@dataclass
class Speculator:
    """What the engine holds: the drafter, k, and totals (for /metrics)."""

    config: SpeculativeConfig
    drafter: Drafter
    stats: SpecStats = field(default_factory=SpecStats)

    def draft_size(self, seq) -> int:
        """Draft tokens worth proposing: the round emits up to k + 1 tokens and must stop at max_tokens."""
        if seq.params.logprobs is not None:  # logprobs are reported by the plain decode path only
            return 0
        return min(self.config.num_draft_tokens, seq.max_tokens - len(seq.output_ids) - 1)

    def record(self, seq, proposed: int, accepted: int) -> None:
        seq.spec.add(proposed, accepted)
        self.stats.add(proposed, accepted)
