"""Qwen3-MoE family. Definition follows transformers' Qwen3MoeModel.

Attention is Qwen3's (q_norm / k_norm). The MLP of layer i is a sparse MoE block (softmax router,
top `num_experts_per_tok`, renormalized when `norm_topk_prob`) unless i is in `mlp_only_layers` or
(i + 1) is not a multiple of `decoder_sparse_step`; those layers get a dense SwiGLU of `intermediate_size`.
With `use_sliding_window`, every layer attends to the last `sliding_window` keys (transformers ignores
`max_window_layers` for this family).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from . import qwen3
from .moe import SparseMoeBlock, stack_experts
from .transformer import GatedMLP, TransformerArgs


@dataclass
class ModelArgs(TransformerArgs):
    model_type: str = "qwen3_moe"
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    use_sliding_window: bool = False
    # Hub checkpoints write num_experts; transformers 5 saves it as num_local_experts (attribute_map).
    num_experts: int | None = None
    num_local_experts: int | None = None
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    def __post_init__(self):
        super().__post_init__()
        if self.num_experts is None:
            self.num_experts = self.num_local_experts if self.num_local_experts is not None else 128
        self.mlp_only_layers = list(self.mlp_only_layers or [])
        window = self.sliding_window if self.use_sliding_window else None
        self.windows = [window] * self.num_hidden_layers

    def is_sparse(self, layer_idx: int) -> bool:
        return (
            layer_idx not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )


class Model(qwen3.Model):
    @staticmethod
    def make_mlp(args: ModelArgs, layer_idx: int) -> nn.Module:
        if args.is_sparse(layer_idx):
            return SparseMoeBlock(
                args.hidden_size,
                args.moe_intermediate_size,
                args.num_experts,
                args.num_experts_per_tok,
                args.norm_topk_prob,
            )
        return GatedMLP(args.hidden_size, args.intermediate_size)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = super().sanitize(weights)
        for i in range(self.args.num_hidden_layers):
            if self.args.is_sparse(i):
                weights = stack_experts(weights, f"model.layers.{i}.mlp", self.args.num_experts)
        return weights
