"""Pieces every model family shares: config dataclass base, the model/cache protocols, attention."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import mlx.core as mx


@dataclass
class BaseModelArgs:
    """Built from config.json; keys the dataclass does not declare are ignored."""

    @classmethod
    def from_dict(cls, params: dict[str, Any]):
        fields = inspect.signature(cls).parameters
        return cls(**{k: v for k, v in params.items() if k in fields})


@runtime_checkable
class Quantizable(Protocol):
    """A layer MLX can swap for its quantized form (Linear, Embedding, the MoE expert banks).

    Only the method is in the protocol: since Python 3.12, isinstance() on a runtime protocol looks members up
    statically, and an nn.Module keeps `weight` in its dict, not as an attribute (see is_quantizable)."""

    def to_quantized(self, group_size: int, bits: int, mode: str = "affine"): ...


def is_quantizable(module: Any) -> bool:
    """A Quantizable layer that has its weight (the weight is what decides the groups)."""
    return isinstance(module, Quantizable) and "weight" in module


class LayerCache(Protocol):
    """Per-layer KV storage. It owns how attention reads it (dense, quantized, paged)."""

    @property
    def offset(self) -> int | mx.array:
        """Position of the next token: an int, or one per batch row."""

    def attend(
        self,
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> mx.array:
        """Store the new keys/values [B, Hkv, L, D] and return attention output [B, Hq, L, D]."""


class CausalLM(Protocol):
    """The contract the engine relies on: logits for `inputs` [B, L] given per-layer caches."""

    layers: Sequence[Any]
    max_context_length: int

    def __call__(
        self, inputs: mx.array, cache: Sequence[LayerCache] | None = None, last_only: bool = False
    ) -> mx.array:
        """Logits [B, L, V]; `last_only`: [B, 1, V] of the last position (the LM head and the last layer past its
        attention skip the others)."""


def causal_mask(
    query_len: int, key_len: int, left_padding: mx.array | None = None, window: int | None = None
) -> mx.array | str | None:
    """Mask for `query_len` new tokens attending to `key_len` keys (the last query_len are the new ones).

    Returns None or "causal" when MLX's fused attention can build it itself, else a boolean
    [B or 1, 1, L, S] array that also hides each row's left padding and keys outside the window
    (a query sees keys with q - k < window, as transformers' sliding-window mask).
    """
    if left_padding is None and (window is None or window >= key_len):
        return "causal" if query_len > 1 else None
    q_pos = mx.arange(key_len - query_len, key_len)[:, None]
    k_pos = mx.arange(key_len)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask = mx.logical_and(mask, k_pos > q_pos - window)
    mask = mask[None, None]
    if left_padding is not None:
        mask = mx.logical_and(mask, k_pos[None, None] >= left_padding[:, None, None, None])
    return mask


def scaled_dot_product_attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask, softcap: float | None = None
) -> mx.array:
    """MLX's fused attention, or the explicit form when logits are soft-capped (Gemma 2)."""
    if softcap is None:
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
    n_rep = queries.shape[1] // keys.shape[1]
    if n_rep > 1:
        keys = mx.repeat(keys, n_rep, axis=1)
        values = mx.repeat(values, n_rep, axis=1)
    scores = (queries * scale) @ keys.swapaxes(-1, -2)
    scores = mx.tanh(scores / softcap) * softcap
    if isinstance(mask, str):  # "causal": spell it out, the explicit path has no built-in form
        query_len, key_len = queries.shape[2], keys.shape[2]
        mask = mx.arange(key_len)[None, :] <= mx.arange(key_len - query_len, key_len)[:, None]
    if mask is not None:
        # A finite floor, not -inf: a query with no visible key (a pad row) must not turn into NaN.
        scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
    return mx.softmax(scores.astype(mx.float32), axis=-1).astype(values.dtype) @ values


def attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: LayerCache | None,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> mx.array:
    """What every family's attention calls after projecting q/k/v and applying RoPE."""
    if cache is not None:
        return cache.attend(queries, keys, values, scale, window=window, softcap=softcap)
    mask = causal_mask(queries.shape[2], keys.shape[2], None, window)
    return scaled_dot_product_attention(queries, keys, values, scale, mask, softcap)


def cache_offset(cache: LayerCache | None) -> int | mx.array:
    return 0 if cache is None else cache.offset


def normed(x: mx.array, norm: Callable[[mx.array], mx.array] | None) -> mx.array:
    """norm(x), or x when there is no norm: a block whose input norm may be applied inside it (DecoderLayer's norm=)."""
    return x if norm is None else norm(x)
