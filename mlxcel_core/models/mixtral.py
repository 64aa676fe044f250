"""Mixtral family. Definition follows transformers' MixtralModel.

Llama attention (optionally sliding-window on every layer) with a sparse MoE block in place of the
MLP: softmax router, top `num_experts_per_tok` (2), weights renormalized over the selected experts,
SwiGLU experts of `intermediate_size` (checkpoint names w1 = gate, w3 = up, w2 = down).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx

from .llama import make_attention
from .moe import SparseMoeBlock, stack_experts
from .transformer import DecoderLayer, TransformerArgs, TransformerLM


@dataclass
class ModelArgs(TransformerArgs):
    model_type: str = "mixtral"
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096 * 32
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    # What llama.make_attention reads; Mixtral has neither.
    attention_bias: bool = False
    rope_traditional: bool = False

    default_rope_theta: ClassVar[float] = 1e6  # MixtralConfig's default


class Model(TransformerLM):
    def __init__(self, args: ModelArgs):
        layers = [
            DecoderLayer(
                args,
                make_attention(args),
                SparseMoeBlock(
                    args.hidden_size,
                    args.intermediate_size,
                    args.num_local_experts,
                    args.num_experts_per_tok,
                    norm_topk_prob=True,
                ),
                mlp_name="block_sparse_moe",
            )
            for _ in range(args.num_hidden_layers)
        ]
        super().__init__(args, layers)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = super().sanitize(weights)
        # transformers' in-memory names (`mlp.gate`, fused `mlp.experts.*`) -> the checkpoint's `block_sparse_moe`
        weights = {
            k.replace(".mlp.", ".block_sparse_moe.") if k.startswith("model.layers.") else k: v
            for k, v in weights.items()
        }
        for i in range(self.args.num_hidden_layers):
            weights = stack_experts(
                weights, f"model.layers.{i}.block_sparse_moe", self.args.num_local_experts, scheme="mixtral"
            )
        return weights
