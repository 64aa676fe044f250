"""Pieces every model family shares: config dataclass base, the model/cache protocols, attention."""

from __future__ import annotations

import inspect
import re
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
        sinks: mx.array | None = None,
        values_in_keys: int | None = None,
        chunk: int | None = None,
    ) -> mx.array:
        """Store the new keys/values [B, Hkv, L, D] and return attention output [B, Hq, L, D]. `sinks` [Hq]: a
        learned logit per query head in the softmax's denominator (gpt-oss); attention() passes it only when set.
        `values_in_keys` n (multi-head latent attention, DeepSeek-V3): the values are keys[..., :n], `values` is not
        read and only the keys are stored; the output is [B, Hq, L, n]. attention() passes it only when set.
        `chunk` (Llama 4): a query sees only the keys of its own chunk of positions (causal_mask); passed when set."""

    def attend_stored(
        self, queries: mx.array, scale: float, window: int | None = None, softcap: float | None = None
    ) -> mx.array:
        """Attention over the keys/values already stored (the current step's, which this layer's `attend` just
        wrote, included), storing nothing: a KV-shared layer (Gemma 4) reads its source layer's cache this way."""


class RecurrentCache(Protocol):
    """What a recurrent layer (gated delta-net, short convolution, Mamba) reads and writes instead of keys and values:
    a fixed-size state per batch row that its forward carries from one call to the next. Every storage's per-layer
    cache of such a layer implements it (cache.KVCache, the paged storage's state views, engine/state_pool.py)."""

    def recurrent_state(self) -> list[mx.array] | None:
        """The layer's state parts per row ([B, ...] each, in the order `update_state` stored them) before this
        forward's tokens; None: every row starts from zeros (a sequence's first tokens)."""

    def update_state(self, state: list[mx.array], length: int) -> None:
        """Keep `state` (each part [B, ...]) as the rows' state after this forward's `length` new tokens."""

    @property
    def state_padding(self) -> mx.array | None:
        """int [B]: the left-padding columns of each row in this forward's inputs (prompts prefilled together), which
        must leave the state as it is (the layer zeroes their inputs); None when no row is padded.

        A cache may also say `decode_tokens` (True): this forward's tokens are generated ones, several at a time
        (speculative verification, engine/recurrent_rollback.py), which a model whose prompt maths differ from its
        decode step's (Nemotron-H's dt clamp) computes as decode steps; or `prompt_tokens` (True): they are a prefill
        chunk's, prompt maths even for one token."""


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
    query_len: int,
    key_len: int,
    left_padding: mx.array | None = None,
    window: int | None = None,
    chunk: int | None = None,
) -> mx.array | str | None:
    """Mask for `query_len` new tokens attending to `key_len` keys (the last query_len are the new ones).

    Returns None or "causal" when MLX's fused attention can build it itself, else a boolean
    [B or 1, 1, L, S] array that also hides each row's left padding and keys outside the window
    (a query sees keys with q - k < window, as transformers' sliding-window mask). `chunk` (Llama 4's chunked local
    attention): a query sees only the keys of its own chunk of `chunk` positions (q // chunk == k // chunk, positions
    counted from each row's first real column, as transformers' chunked mask).
    """
    within_chunk = chunk is None or chunk >= key_len
    if left_padding is None and (window is None or window >= key_len) and within_chunk:
        return "causal" if query_len > 1 else None
    q_pos = mx.arange(key_len - query_len, key_len)[:, None]
    k_pos = mx.arange(key_len)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask = mx.logical_and(mask, k_pos > q_pos - window)
    if not within_chunk and left_padding is None:
        mask = mx.logical_and(mask, k_pos // chunk == q_pos // chunk)
    mask = mask[None, None]
    if left_padding is not None:
        pad = left_padding[:, None, None, None]
        mask = mx.logical_and(mask, k_pos[None, None] >= pad)
        if not within_chunk:  # chunks start at each row's first real column
            mask = mx.logical_and(mask, (k_pos - pad) // chunk == (q_pos - pad) // chunk)
    return mask


def scaled_dot_product_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    mask,
    softcap: float | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """MLX's fused attention, or the explicit form when logits are soft-capped (Gemma 2).

    `sinks` [Hq] (gpt-oss): one more logit per query head in each softmax, whose probability is dropped (transformers'
    eager_attention_forward concatenates it to the scores); MLX's fused attention takes it as `sinks=`."""
    if sinks is not None:
        sinks = sinks.astype(queries.dtype)  # MLX wants the sinks' type to promote to the output's
    if softcap is None:
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
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
    if sinks is None:
        return mx.softmax(scores.astype(mx.float32), axis=-1).astype(values.dtype) @ values
    sink_column = mx.broadcast_to(sinks.reshape(1, -1, 1, 1), (*scores.shape[:-1], 1)).astype(mx.float32)
    probs = mx.softmax(mx.concatenate([scores.astype(mx.float32), sink_column], axis=-1), axis=-1)
    return probs[..., :-1].astype(values.dtype) @ values


def attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: LayerCache | None,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: mx.array | None = None,
    values_in_keys: int | None = None,
    chunk: int | None = None,
) -> mx.array:
    """What every family's attention calls after projecting q/k/v and applying RoPE. `sinks` reaches the cache only
    when set, so a LayerCache written before sinks existed still serves the families without them; so do
    `values_in_keys` (LayerCache.attend: the values are keys[..., :n], `values` may be None) and `chunk` (Llama 4's
    chunked local attention: causal_mask)."""
    if cache is not None:
        optional = (("sinks", sinks), ("values_in_keys", values_in_keys), ("chunk", chunk))
        extra = {name: value for name, value in optional if value is not None}
        return cache.attend(queries, keys, values, scale, window=window, softcap=softcap, **extra)
    if values_in_keys is not None:
        values = keys[..., :values_in_keys]
    mask = causal_mask(queries.shape[2], keys.shape[2], None, window, chunk)
    return scaled_dot_product_attention(queries, keys, values, scale, mask, softcap, sinks)


def kv_layout(model) -> list[tuple[int, int] | None]:
    """Per layer, (KV heads, head dim) of what its cache stores, None where it stores nothing (a KV-shared layer, which
    reads another layer's cache): the model's own `kv_layout()` where its layers differ (Gemma 4), else every layer
    stores the config's num_key_value_heads x head_dim."""
    if hasattr(model, "kv_layout"):
        return model.kv_layout()
    args = model.args
    heads = getattr(args, "num_key_value_heads", None) or args.num_attention_heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    return [(heads, head_dim)] * len(model.layers)


# A part of a recurrent layer's per-row state: its shape per row and its dtype (None: the model's activations' dtype).
StatePart = tuple[tuple[int, ...], Any]


def state_layout(model) -> list[tuple[StatePart, ...] | None]:
    """Per layer, the parts of the recurrent state it keeps per sequence (RecurrentCache), None for a layer that keeps
    none (attention): the model's own `state_layout()` where it has recurrent layers, else None everywhere."""
    if hasattr(model, "state_layout"):
        return model.state_layout()
    return [None] * len(model.layers)


def has_recurrent_layers(model) -> bool:
    """Whether any layer keeps a recurrent state (such a model's state cannot be cut back to fewer tokens)."""
    return any(layout is not None for layout in state_layout(model))


def cache_offset(cache: LayerCache | None) -> int | mx.array:
    return 0 if cache is None else cache.offset


def normed(x: mx.array, norm: Callable[[mx.array], mx.array] | None) -> mx.array:
    """norm(x), or x when there is no norm: a block whose input norm may be applied inside it (DecoderLayer's norm=)."""
    return x if norm is None else norm(x)


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def drop_extra_layers(weights: dict[str, mx.array], num_layers: int) -> dict[str, mx.array]:
    """Without the tensors of layers num_layers and above: the multi-token-prediction layers DeepSeek-V3 and GLM-4.5
    checkpoints append, which plain decoding does not run."""

    def kept(name: str) -> bool:
        match = _LAYER.match(name)
        return match is None or int(match.group(1)) < num_layers

    return {k: v for k, v in weights.items() if kept(k)}
