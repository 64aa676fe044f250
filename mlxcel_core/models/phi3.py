"""Phi-3 / Phi-3.5 / Phi-4-mini (model_type phi3). Definition follows transformers' Phi3Model.

Differs from Llama in fused projections (qkv_proj, gate_up_proj), LongRoPE ("su") scaling with a top-level
`original_max_position_embeddings`, optional partial rotary (`partial_rotary_factor`, Phi-4-mini) and an
optional sliding window (honoured, as transformers does). See rope.py for what LongRoPE does when a KV cache
grows past original_max_position_embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from .activations import swiglu
from .base import normed
from .rope import initialize_rope
from .transformer import Attention, DecoderLayer, TransformerArgs, TransformerLM, add_projection


@dataclass
class ModelArgs(TransformerArgs):
    model_type: str = "phi3"
    rms_norm_eps: float = 1e-5
    original_max_position_embeddings: int | None = None
    partial_rotary_factor: float | None = None

    def __post_init__(self):
        super().__post_init__()
        params = self.rope_parameters or {}
        factor = params.get("partial_rotary_factor", self.partial_rotary_factor)
        self.rotary_dims = int(self.head_dim * (1.0 if factor is None else float(factor)))
        scaling = self.rope_scaling
        # transformers' Phi3Config maps "su" and "yarn" to longrope (Phi-3 "yarn" configs carry longrope factors).
        if scaling is not None and scaling["rope_type"] in ("su", "yarn") and "long_factor" in scaling:
            scaling["rope_type"] = "longrope"


class FusedAttention(Attention):
    """q, k, v from one `qkv_proj` (in that order along the output dimension); no biases."""

    def init_projections(self, hidden_size: int, bias: bool, o_bias: bool) -> None:
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, hidden_size, bias=o_bias)

    def project(self, x: mx.array, norm: nn.Module | None = None) -> tuple[mx.array, mx.array, mx.array]:
        x = normed(x, norm)
        return tuple(mx.split(self.qkv_proj(x), [self.q_size, self.q_size + self.kv_size], axis=-1))


class MLP(nn.Module):
    """SwiGLU with gate and up fused in `gate_up_proj` (gate first)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def __call__(self, x: mx.array, residual: mx.array | None = None, norm: nn.Module | None = None) -> mx.array:
        x = normed(x, norm)
        gate, up = mx.split(self.gate_up_proj(x), 2, axis=-1)
        return add_projection(self.down_proj, swiglu(gate, up), residual)


class Model(TransformerLM):
    def __init__(self, args: ModelArgs):
        def attention() -> FusedAttention:
            rope = initialize_rope(
                args.rotary_dims,
                args.rope_base,
                False,
                args.rope_scaling,
                max_position_embeddings=args.max_position_embeddings,
                original_max_position_embeddings=args.original_max_position_embeddings,
            )
            return FusedAttention(args, rope, window=args.sliding_window)

        super().__init__(args, [DecoderLayer(args, attention(), MLP(args)) for _ in range(args.num_hidden_layers)])
