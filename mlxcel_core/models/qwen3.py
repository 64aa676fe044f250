"""Qwen3 family (dense). Definition follows transformers' Qwen3Model.

Differences from Qwen2: no q/k/v bias (`attention_bias`, off by default), an explicit `head_dim`,
and per-head RMSNorm on queries and keys (q_norm / k_norm) before RoPE. Sliding-window layers are
chosen as in Qwen2 (`layer_types`, else `use_sliding_window` + `max_window_layers`).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.nn as nn

from . import qwen2
from .transformer import Attention, DecoderLayer, GatedMLP, TransformerLM


@dataclass
class ModelArgs(qwen2.ModelArgs):
    model_type: str = "qwen3"
    head_dim: int | None = 128  # Qwen3Config's default, not hidden_size // heads
    attention_bias: bool = False


def make_attention(args, window: int | None) -> Attention:
    """Shared with Qwen3-MoE: reads hidden_size, head counts, head_dim, attention_bias, rms_norm_eps, rope_*."""
    return Attention(args, qwen2.make_rope(args), bias=args.attention_bias, window=window, qk_norm=nn.RMSNorm)


class Model(TransformerLM):
    """Qwen3-MoE subclasses this, overriding `make_mlp` and `sanitize`."""

    def __init__(self, args):
        layers = [
            DecoderLayer(args, make_attention(args, args.windows[i]), self.make_mlp(args, i))
            for i in range(args.num_hidden_layers)
        ]
        super().__init__(args, layers)

    @staticmethod
    def make_mlp(args, layer_idx: int) -> nn.Module:
        return GatedMLP(args.hidden_size, args.intermediate_size)
