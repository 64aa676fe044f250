"""Llama family: Llama 2/3, SmolLM2, Mistral (full attention). Definition follows transformers' LlamaModel.

The reference layout of transformer.py: q/k/v/o and the SwiGLU MLP with optional biases, RoPE (optionally
traditional / scaled) on every layer, and Mistral v0.1's sliding window on every layer when set.
"""

from __future__ import annotations

from dataclasses import dataclass

from .rope import initialize_rope
from .transformer import Attention, DecoderLayer, GatedMLP, TransformerArgs, TransformerLM


@dataclass
class ModelArgs(TransformerArgs):
    model_type: str = "llama"
    rope_traditional: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False


def make_attention(args) -> Attention:
    """Shared with Mixtral: q/k/v/o biases from `attention_bias`, `sliding_window` (None = full) everywhere."""
    rope = initialize_rope(args.head_dim, args.rope_base, args.rope_traditional, args.rope_scaling)
    return Attention(args, rope, bias=args.attention_bias, window=args.sliding_window)


class Model(TransformerLM):
    def __init__(self, args: ModelArgs):
        layers = [
            DecoderLayer(
                args, make_attention(args), GatedMLP(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
            )
            for _ in range(args.num_hidden_layers)
        ]
        super().__init__(args, layers)
