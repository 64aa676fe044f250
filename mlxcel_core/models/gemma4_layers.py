"""Gemma 4 text layers; definitions follow transformers' modeling_gemma4.py (Gemma4TextAttention, Gemma4TextRouter,
Gemma4TextExperts, Gemma4TextDecoderLayer).

What differs from Gemma 3's layers (gemma_common): the norms scale by `weight`, not `1 + weight` (nn.RMSNorm), the
attention scale is 1.0 (q and k are RMS-normed per head), the values are RMS-normed per head without a gain, and each
layer type has its own head size and KV heads (`ModelArgs.head_dim_of`, `kv_heads_of`). A KV-shared layer has no key
or value projection: it attends over the keys and values another layer stored (`kv_source`), reading that layer's
cache (`LayerCache.attend_stored`) or, without caches, the arrays that layer computed. `attention_k_eq_v` full layers
take their values from the key projection (before its norm). Each decoder layer adds a per-layer input (PLE: a gated
projection of the layer's slice of the per-layer embeddings), may run a MoE block beside its dense MLP, and ends
scaled by its `layer_scalar`.

Not transformer.Attention: a KV-shared layer lacks the k/v projections that its subclasses (and the CUDA backend's
fused q/k/v projection) assume.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .activations import geglu
from .base import LayerCache, attention
from .moe import SwitchGLU
from .rope import RoPE
from .transformer import GatedMLP, heads_first, heads_last, times

SLIDING, FULL = "sliding_attention", "full_attention"


def unit_rms_norm(x: mx.array, eps: float) -> mx.array:
    """x / rms(x): Gemma4RMSNorm(with_scale=False), the values' norm and the router's."""
    return mx.fast.rms_norm(x, None, eps)


class Gemma4Attention(nn.Module):
    """Gemma4TextAttention: q (and, where the layer stores KV, k) RMS-normed per head and rotated by the layer type's
    RoPE, values RMS-normed without a gain, scale 1.0, a sliding window on sliding layers."""

    def __init__(self, args, layer: int, rope: RoPE):
        super().__init__()
        sliding = args.layer_types[layer] == SLIDING
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.kv_heads_of(layer)
        self.head_dim = args.head_dim_of(layer)
        self.window = args.sliding_window if sliding else None
        self.scale = 1.0
        self.eps = args.rms_norm_eps
        self.stores_kv = args.kv_source(layer) == layer
        self.k_eq_v = args.attention_k_eq_v and not sliding
        hidden, bias = args.hidden_size, args.attention_bias
        self.q_proj = nn.Linear(hidden, self.n_heads * self.head_dim, bias=bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=self.eps)
        if self.stores_kv:
            self.k_proj = nn.Linear(hidden, self.n_kv_heads * self.head_dim, bias=bias)
            if not self.k_eq_v:
                self.v_proj = nn.Linear(hidden, self.n_kv_heads * self.head_dim, bias=bias)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=self.eps)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, hidden, bias=bias)
        self.rope = rope

    def keys_values(self, x: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array]:
        """This layer's keys (normed, rotated) and values (normed) [B, Hkv, L, head_dim] of x."""
        raw = heads_first(self.k_proj(x), self.n_kv_heads)
        values = raw if self.k_eq_v else heads_first(self.v_proj(x), self.n_kv_heads)
        return self.rope(self.k_norm(raw), offset), unit_rms_norm(values, self.eps)

    def __call__(
        self,
        x: mx.array,
        cache: LayerCache | None,
        offset: int | mx.array,
        shared: tuple[mx.array, mx.array] | None = None,
        last_only: bool = False,
    ) -> tuple[mx.array, tuple[mx.array, mx.array] | None]:
        """(output, (keys, values) where this layer computed them without a cache, else None). `cache`: this layer's,
        or, for a KV-shared layer, its source layer's (read, not written); `shared`: the source layer's keys and
        values when there are no caches. `offset`: the position of x's first row (RoPE)."""
        queries = self.rope(self.q_norm(heads_first(self.q_proj(x), self.n_heads)), offset)
        if last_only:  # one query, at the last position: the masks align queries with the last keys
            queries = queries[:, :, -1:, :]
        computed = None
        if not self.stores_kv:
            if cache is not None:
                out = cache.attend_stored(queries, self.scale, window=self.window)
            else:
                out = attention(queries, *shared, None, self.scale, window=self.window)
        else:
            keys, values = self.keys_values(x, offset)
            out = attention(queries, keys, values, cache, self.scale, window=self.window)
            computed = (keys, values) if cache is None else None
        return self.o_proj(heads_last(out)), computed


class Gemma4Router(nn.Module):
    """Gemma4TextRouter: the unit-normed input, scaled per channel by `scale` and by hidden_size ** -0.5, projected
    to expert logits; softmax (fp32), top k, renormalized, times each chosen expert's `per_expert_scale`."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, eps: float):
        super().__init__()
        self.proj = nn.Linear(hidden_size, num_experts, bias=False)
        self.scale = mx.ones((hidden_size,))
        self.per_expert_scale = mx.ones((num_experts,))
        self.top_k, self.eps, self.root_size = top_k, eps, hidden_size**-0.5

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """(expert indices [..., k], their weights [..., k] in float32)."""
        x = times(unit_rms_norm(x, self.eps) * self.scale, self.root_size)
        probs = mx.softmax(self.proj(x).astype(mx.float32), axis=-1)
        k = self.top_k
        indices = mx.stop_gradient(mx.argpartition(-probs, kth=k - 1, axis=-1)[..., :k])
        weights = mx.take_along_axis(probs, indices, axis=-1)
        weights = weights / weights.sum(axis=-1, keepdims=True)
        return indices, weights * self.per_expert_scale[indices].astype(mx.float32)


class Gemma4Experts(nn.Module):
    """Gemma4TextExperts: GeGLU experts (`switch_glu`, mlx-lm's name; transformers' fused `gate_up_proj` /
    `down_proj` are split into it at load), each token's k outputs summed with the router's weights."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int):
        super().__init__()
        self.switch_glu = SwitchGLU(hidden_size, intermediate_size, num_experts, activation=geglu)

    def __call__(self, x: mx.array, indices: mx.array, weights: mx.array) -> mx.array:
        y = self.switch_glu(x, indices)
        return (y * weights[..., None].astype(y.dtype)).sum(axis=-2)


class Gemma4DecoderLayer(nn.Module):
    """Gemma4TextDecoderLayer: sandwich-normed attention and feed-forward (the dense GeGLU MLP, plus beside it, with
    `enable_moe_block`, the experts fed the un-normed residual's routing), then the per-layer input, then
    `layer_scalar`."""

    def __init__(self, args, layer: int, rope: RoPE):
        super().__init__()
        dims, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = Gemma4Attention(args, layer, rope)
        self.mlp = GatedMLP(dims, args.mlp_width_of(layer), activation=geglu)
        self.input_layernorm = nn.RMSNorm(dims, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(dims, eps=eps)
        self.pre_feedforward_layernorm = nn.RMSNorm(dims, eps=eps)
        self.post_feedforward_layernorm = nn.RMSNorm(dims, eps=eps)
        self.layer_scalar = mx.ones((1,))
        self.per_layer = bool(args.hidden_size_per_layer_input)
        if self.per_layer:
            self.per_layer_input_gate = nn.Linear(dims, args.hidden_size_per_layer_input, bias=False)
            self.per_layer_projection = nn.Linear(args.hidden_size_per_layer_input, dims, bias=False)
            self.post_per_layer_input_norm = nn.RMSNorm(dims, eps=eps)
        self.moe = args.enable_moe_block
        if self.moe:
            self.router = Gemma4Router(dims, args.num_experts, args.top_k_experts, eps)
            self.experts = Gemma4Experts(dims, args.moe_intermediate_size, args.num_experts)
            self.post_feedforward_layernorm_1 = nn.RMSNorm(dims, eps=eps)
            self.post_feedforward_layernorm_2 = nn.RMSNorm(dims, eps=eps)
            self.pre_feedforward_layernorm_2 = nn.RMSNorm(dims, eps=eps)

    def feed_forward(self, h: mx.array) -> mx.array:
        """The block after the attention's residual add, before its post-norm: the MLP, or MLP + experts."""
        out = self.mlp(self.pre_feedforward_layernorm(h))
        if not self.moe:
            return out
        indices, weights = self.router(h)
        experts = self.experts(self.pre_feedforward_layernorm_2(h), indices, weights)
        return self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(experts)

    def __call__(
        self,
        x: mx.array,
        cache: LayerCache | None,
        offset: int | mx.array,
        per_layer_input: mx.array | None,
        shared: tuple[mx.array, mx.array] | None = None,
        last_only: bool = False,
    ) -> tuple[mx.array, tuple[mx.array, mx.array] | None]:
        """(hidden states, the keys and values the attention computed without a cache); `last_only`: the last
        position's hidden state only (every position's keys and values stored)."""
        attended, computed = self.self_attn(self.input_layernorm(x), cache, offset, shared, last_only)
        if last_only:
            x = x[:, -1:, :]
            per_layer_input = None if per_layer_input is None else per_layer_input[:, -1:, :]
        h = x + self.post_attention_layernorm(attended)
        h = h + self.post_feedforward_layernorm(self.feed_forward(h))
        if self.per_layer:
            gated = geglu(self.per_layer_input_gate(h), per_layer_input)
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return h * self.layer_scalar, computed
