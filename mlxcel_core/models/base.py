"""Pieces every model family shares: config dataclass base, the model protocol, attention masks."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import mlx.core as mx


@dataclass
class BaseModelArgs:
    """Built from config.json; keys the dataclass does not declare are ignored."""

    @classmethod
    def from_dict(cls, params: dict[str, Any]):
        fields = inspect.signature(cls).parameters
        return cls(**{k: v for k, v in params.items() if k in fields})


class LayerCache(Protocol):
    """What attention needs from a per-layer KV cache (see mlxcel_core.cache)."""

    offset: int

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]: ...

    def attention_mask(self, query_len: int) -> mx.array | str | None: ...


class CausalLM(Protocol):
    """The contract the engine relies on: logits for `inputs` [B, L] given per-layer caches."""

    layers: Sequence[Any]
    max_context_length: int

    def __call__(self, inputs: mx.array, cache: Sequence[LayerCache] | None = None) -> mx.array: ...


def causal_mask(query_len: int, key_len: int, left_padding: mx.array | None = None) -> mx.array | str | None:
    """Mask for `query_len` new tokens attending to `key_len` keys (the last query_len are the new ones).

    Returns None or "causal" when MLX's fused attention can build it itself, else a boolean
    [B, 1, L, S] array that also hides each row's left padding.
    """
    if left_padding is None:
        return "causal" if query_len > 1 else None
    q_pos = mx.arange(key_len - query_len, key_len)[:, None]
    k_pos = mx.arange(key_len)[None, :]
    mask = (k_pos <= q_pos)[None, None]
    not_pad = k_pos[None, None] >= left_padding[:, None, None, None]
    return mx.logical_and(mask, not_pad)
