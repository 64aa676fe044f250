"""Phi-3 / Phi-3.5 / Phi-4-mini (model_type phi3). Definition follows transformers' Phi3Model.

Differs from Llama in fused projections (qkv_proj, gate_up_proj), LongRoPE ("su") scaling with a top-level
`original_max_position_embeddings`, optional partial rotary (`partial_rotary_factor`, Phi-4-mini) and an
optional sliding window (honoured, as transformers does). See rope.py for what LongRoPE does when a KV cache
grows past original_max_position_embeddings.
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


@dataclass
class ModelArgs(BaseModelArgs):
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    model_type: str = "phi3"
    rms_norm_eps: float = 1e-5
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 4096
    original_max_position_embeddings: int | None = None
    rope_theta: float | None = None
    rope_parameters: dict[str, Any] | None = None
    rope_scaling: dict[str, Any] | None = None
    partial_rotary_factor: float | None = None
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.hidden_act != "silu":
            raise UnsupportedModelError(f"hidden_act '{self.hidden_act}' is not supported for phi3")
        params = self.rope_parameters or {}
        factor = params.get("partial_rotary_factor", self.partial_rotary_factor)
        self.rotary_dims = int(self.head_dim * (1.0 if factor is None else float(factor)))
        self.rope_base = rope_base(self.rope_theta, self.rope_parameters)
        scaling = rope_scaling_config(self.rope_scaling, self.rope_parameters)
        # transformers' Phi3Config maps "su" and "yarn" to longrope (Phi-3 "yarn" configs carry longrope factors).
        if scaling is not None and scaling["rope_type"] in ("su", "yarn") and "long_factor" in scaling:
            scaling["rope_type"] = "longrope"
        self.rope_scaling = scaling


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = self.head_dim**-0.5
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, args.hidden_size, bias=False)
        self.rope = initialize_rope(args.rotary_dims, args.rope_base, False, args.rope_scaling,
                                    max_position_embeddings=args.max_position_embeddings,
                                    original_max_position_embeddings=args.original_max_position_embeddings)
        self.window = args.sliding_window

    def __call__(self, x: mx.array, cache: LayerCache | None) -> mx.array:
        B, L, _ = x.shape
        q, k, v = mx.split(self.qkv_proj(x), [self.q_size, self.q_size + self.kv_size], axis=-1)
        q = q.reshape(B, L, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)
        k = k.reshape(B, L, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        v = v.reshape(B, L, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        offset = cache_offset(cache)
        out = attention(self.rope(q, offset), self.rope(k, offset), v, cache, self.scale, window=self.window)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = mx.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj(swiglu(gate, up))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, cache: LayerCache | None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Phi3Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args) for _ in range(args.num_hidden_layers)]
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
        self.model = Phi3Model(args)
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
