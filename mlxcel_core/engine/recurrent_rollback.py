"""Rejected draft tokens taken back out of a recurrent state, exactly (speculative decoding with gated delta-net,
short convolution or Mamba layers: qwen3_5, qwen3_next, lfm2, nemotron_h).

A recurrent layer's state holds every token it has seen and cannot be cut back (cache.py), so speculation keeps
checkpoints of it instead:

- The target. Before the verify forward the storage checkpoints the sequence (`KVStorage.checkpoint`: its KV length
  and the recurrent layers' state arrays, kept by reference: a forward replaces state arrays, it never writes into
  them, so the copy costs nothing). When verification accepts k of n draft tokens with k < n, the storage goes back
  to the checkpoint (`KVStorage.restore`) and the k + 1 kept tokens (the token before the draft, then the accepted
  draft tokens) run through the whole model again (`rerun`): that rebuilds the state and rewrites the same keys and
  values. The target's own token after them is fed by the next round, as without recurrent layers. Cost: one extra
  forward of k + 1 tokens in every round that rejects a draft token, none in a round that accepts them all.
  Chosen over states per position out of the verify forward (the delta rule, the SSD scan and the convolutions
  returning the state after every position, the verification keeping the k-th): that saves the extra forward but
  changes every family's recurrent kernels; re-running is exact with the layers as they are.
- A draft model. It feeds its draft tokens one forward each, so it keeps the state after each of them
  (`checkpoint` of its dense caches, by reference again) and goes back to the one at the accepted length
  (speculative.DraftModelDrafter): no extra forward.

Forwards over generated tokens (verification, re-run) say so to the model (`DecodeTokens`): Nemotron-H computes a
prompt's tokens with dt clamped and a decode step without, and a generated token must get the decode step's maths
for the speculative output to be the plain one, token for token.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from ..cache import KVCache

# Per layer: the columns a dense cache held and its recurrent state parts then (None: a layer without).
CacheCheckpoint = list[tuple[int, list[mx.array] | None]]


def checkpoint(caches: Sequence[KVCache]) -> CacheCheckpoint:
    """Dense caches as they are now, for `restore`."""
    return [(cache.columns, cache.recurrent) for cache in caches]


def restore(caches: Sequence[KVCache], saved: CacheCheckpoint) -> None:
    """Dense caches back to `saved`: keys and values cut back to its columns (nothing before them was rewritten),
    recurrent states replaced by the ones it kept."""
    for cache, (columns, recurrent) in zip(caches, saved):
        if cache.recurrent is None:
            cache.trim(columns)
        else:
            cache.recurrent, cache.columns = recurrent, columns


class DecodeTokens:
    """A layer's cache for a forward over generated tokens (speculative verification and re-run): it is `cache` in
    every respect, and says `decode_tokens` to a model whose prompt maths differ from its decode step's."""

    decode_tokens = True

    def __init__(self, cache):
        self._cache = cache

    def __getattr__(self, name: str):
        return getattr(self._cache, name)


def decode_tokens(caches: Sequence) -> list[DecodeTokens]:
    return [DecodeTokens(cache) for cache in caches]


class PromptTokens(DecodeTokens):
    """A layer's cache for a forward over prompt tokens (a prefill chunk, which may be one token long): it says
    `prompt_tokens` to a model whose prompt maths differ from its decode step's."""

    decode_tokens = False
    prompt_tokens = True


def prompt_tokens(caches: Sequence) -> list[PromptTokens]:
    return [PromptTokens(cache) for cache in caches]


def rerun(model, storage, seq_id: int, kept: list[int], saved) -> None:
    """Back to the checkpoint `saved` (taken before the verify forward), then the kept tokens through the model again:
    the sequence's caches hold exactly them after its earlier tokens."""
    storage.restore(seq_id, saved)
    caches = storage.extend_caches(seq_id, len(kept))
    model(mx.array([kept]), decode_tokens(caches), last_only=True)  # (only the caches are wanted)
    mx.eval([cache.state for cache in caches])
