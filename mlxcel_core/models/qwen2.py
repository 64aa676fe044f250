"""Qwen2 / Qwen2.5 family. Definition follows transformers' Qwen2Model.

Differences from Llama: q/k/v projections carry a bias (o_proj does not), and layers listed as
"sliding_attention" in `layer_types` (by default those from `max_window_layers` on, when
`use_sliding_window` is set) attend to the last `sliding_window` keys only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..errors import UnsupportedModelError
from .activations import swiglu
from .base import BaseModelArgs, LayerCache, attention, cache_offset
from .rope import initialize_rope, rope_base, rope_scaling_config


def layer_windows(num_layers: int, use_sliding_window: bool, sliding_window: int | None,
                  max_window_layers: int, layer_types: list[str] | None) -> list[int | None]:
    """Each layer's attention window (None = full), as Qwen2Config/Qwen3Config derive it."""
    window = sliding_window if use_sliding_window else None
    if layer_types is None:
        layer_types = ["sliding_attention" if window is not None and i >= max_window_layers else "full_attention"
                       for i in range(num_layers)]
    if len(layer_types) != num_layers:
        raise UnsupportedModelError(f"layer_types lists {len(layer_types)} layers, the model has {num_layers}")
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise UnsupportedModelError(f"layer type(s) {', '.join(unknown)} are not supported")
    return [window if kind == "sliding_attention" else None for kind in layer_types]


@dataclass
class ModelArgs(BaseModelArgs):
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    model_type: str = "qwen2"
    rms_norm_eps: float = 1e-6
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 32768
    rope_theta: float | None = None
    rope_parameters: dict[str, Any] | None = None
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    use_sliding_window: bool = False
    sliding_window: int | None = None
    max_window_layers: int = 28
    layer_types: list[str] | None = None

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.hidden_act != "silu":
            raise UnsupportedModelError(f"hidden_act '{self.hidden_act}' is not supported for {self.model_type}")
        self.rope_base = rope_base(self.rope_theta, self.rope_parameters)
        self.rope_scaling = rope_scaling_config(self.rope_scaling, self.rope_parameters)
        self.windows = layer_windows(self.num_hidden_layers, self.use_sliding_window, self.sliding_window,
                                     self.max_window_layers, self.layer_types)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, window: int | None):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = self.head_dim**-0.5
        self.q_proj = nn.Linear(args.hidden_size, self.n_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=False)
        self.rope = initialize_rope(self.head_dim, args.rope_base, False, args.rope_scaling,
                                    max_position_embeddings=args.max_position_embeddings)
        self.window = window

    def __call__(self, x: mx.array, cache: LayerCache | None) -> mx.array:
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        offset = cache_offset(cache)
        out = attention(self.rope(q, offset), self.rope(k, offset), v, cache, self.scale, window=self.window)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(args, args.windows[layer_idx])
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, cache: LayerCache | None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen2Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache) -> mx.array:
        h = self.embed_tokens(inputs)
        for layer, layer_cache in zip(self.layers, cache or [None] * len(self.layers)):
            h = layer(h, layer_cache)
        return self.norm(h)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = Qwen2Model(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.max_context_length = args.max_position_embeddings

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        h = self.model(inputs, cache)
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    @property
    def layers(self):
        return self.model.layers

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings:
            weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
        return weights
