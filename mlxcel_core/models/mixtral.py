"""Mixtral family. Definition follows transformers' MixtralModel.

Llama attention (optionally sliding-window on every layer) with a sparse MoE block in place of the
MLP: softmax router, top `num_experts_per_tok` (2), weights renormalized over the selected experts,
SwiGLU experts of `intermediate_size` (checkpoint names w1 = gate, w3 = up, w2 = down).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..errors import UnsupportedModelError
from .base import BaseModelArgs, LayerCache
from .llama import Attention
from .moe import SparseMoeBlock, stack_experts
from .rope import rope_base, rope_scaling_config


@dataclass
class ModelArgs(BaseModelArgs):
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    model_type: str = "mixtral"
    rms_norm_eps: float = 1e-5
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 4096 * 32
    rope_theta: float | None = None
    rope_parameters: dict[str, Any] | None = None
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    # What llama.Attention reads; Mixtral has neither.
    attention_bias: bool = False
    rope_traditional: bool = False

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.hidden_act != "silu":
            raise UnsupportedModelError(f"hidden_act '{self.hidden_act}' is not supported for {self.model_type}")
        self.rope_base = rope_base(self.rope_theta, self.rope_parameters, default=1e6)  # MixtralConfig's default
        self.rope_scaling = rope_scaling_config(self.rope_scaling, self.rope_parameters)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)  # window = args.sliding_window on every layer
        self.block_sparse_moe = SparseMoeBlock(args.hidden_size, args.intermediate_size, args.num_local_experts,
                                               args.num_experts_per_tok, norm_topk_prob=True)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, cache: LayerCache | None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache)
        return h + self.block_sparse_moe(self.post_attention_layernorm(h))


class MixtralModel(nn.Module):
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
        self.model = MixtralModel(args)
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
        # transformers' in-memory names (`mlp.gate`, fused `mlp.experts.*`) -> the checkpoint's `block_sparse_moe`
        weights = {k.replace(".mlp.", ".block_sparse_moe.") if k.startswith("model.layers.") else k: v
                   for k, v in weights.items()}
        for i in range(self.args.num_hidden_layers):
            weights = stack_experts(weights, f"model.layers.{i}.block_sparse_moe", self.args.num_local_experts,
                                    scheme="mixtral")
        return weights
