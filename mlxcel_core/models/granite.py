"""Granite 3.x dense. Definition follows transformers' modeling_granite.py (GraniteForCausalLM).

Llama layers (q/k/v/o biases from `attention_bias`, SwiGLU MLP biases from `mlp_bias`, RMSNorm, RoPE on every
layer) with four scalars from config.json:
- `embedding_multiplier`: the token embeddings are multiplied by it;
- `attention_multiplier`: the attention scale (in place of head_dim ** -0.5);
- `residual_multiplier`: each block's output (attention, MLP) is multiplied by it before the residual add;
- `logits_scaling`: the logits are divided by it.
Each is applied as transformers applies a Python float to a tensor (computed in float32, rounded once to the
activations' dtype), so bfloat16 models round where transformers rounds.

Released checkpoints write `rope_theta` + `rope_scaling`; transformers 5 writes `rope_parameters`. Both load.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from . import transformer
from .base import LayerCache
from .rope import initialize_rope
from .transformer import Attention, GatedMLP, TransformerArgs, TransformerLM, times


@dataclass
class ModelArgs(TransformerArgs):
    """Defaults are GraniteConfig's (released checkpoints set all four multipliers)."""

    model_type: str = "granite"
    max_position_embeddings: int = 2048
    attention_bias: bool = False
    mlp_bias: bool = False
    embedding_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0


class DecoderLayer(transformer.DecoderLayer):
    """transformer.DecoderLayer with each block's output times `residual_multiplier` before the residual add:
    h = x + m * attn(norm(x)); out = h + m * mlp(norm(h)). The blocks then return their output alone (no
    `residual=`), the multiplication coming between their output projection and the add."""

    def __init__(self, args: ModelArgs, self_attn: nn.Module, mlp: nn.Module):
        super().__init__(args, self_attn, mlp)
        self.residual_multiplier = float(args.residual_multiplier)

    def scaled(self, x: mx.array) -> mx.array:
        return x if self.residual_multiplier == 1.0 else times(x, self.residual_multiplier)

    def __call__(self, x: mx.array, cache: LayerCache | None, last_only: bool = False) -> mx.array:
        """`last_only`: the last position's output only, every position's keys and values cached."""
        attended = self.self_attn(x, cache, norm=self.input_layernorm, last_only=last_only)
        h = (x[:, -1:, :] if last_only else x) + self.scaled(attended)
        return h + self.scaled(self.mlp(h, norm=self.post_attention_layernorm))


class Model(TransformerLM):
    def __init__(self, args: ModelArgs):
        layers = [
            DecoderLayer(
                args,
                Attention(args, self.make_rope(args), bias=args.attention_bias, scale=float(args.attention_multiplier)),
                GatedMLP(args.hidden_size, args.intermediate_size, bias=args.mlp_bias),
            )
            for _ in range(args.num_hidden_layers)
        ]
        multiplier = float(args.embedding_multiplier)
        super().__init__(args, layers, embed_multiplier=None if multiplier == 1.0 else multiplier)
        self.logits_scaling = float(args.logits_scaling)

    @staticmethod
    def make_rope(args: ModelArgs):
        """The checkpoint's RoPE; YaRN-style scaling may fall back on max_position_embeddings."""
        return initialize_rope(
            args.head_dim,
            args.rope_base,
            False,
            args.rope_scaling,
            max_position_embeddings=args.max_position_embeddings,
        )

    def __call__(self, inputs: mx.array, cache=None, last_only: bool = False) -> mx.array:
        logits = super().__call__(inputs, cache, last_only)
        if self.logits_scaling == 1.0:  # x / 1.0 is x
            return logits
        return (logits / mx.array(self.logits_scaling, dtype=mx.float32)).astype(logits.dtype)
