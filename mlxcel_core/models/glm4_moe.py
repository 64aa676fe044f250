"""GLM-4.5 / GLM-4.5-Air / GLM-4.6 (model_type glm4_moe). Definition follows transformers' Glm4MoeModel.

Attention is Llama's GQA with q/k/v biases (`attention_bias`; o_proj has none), optional per-head RMSNorm of
queries and keys before RoPE (`use_qk_norm`), and partial rotary: RoPE turns the first
head_dim * `partial_rotary_factor` dimensions of each head (half-split, as transformers' rotate_half), the rest pass
through. The factor is read from `rope_parameters` (transformers 5), else the top-level key (the Hub's
checkpoints), else Glm4MoeConfig's default 0.5. The first `first_k_dense_replace` layers have a dense SwiGLU MLP of
`intermediate_size`; the others a GroupedMoeBlock (grouped_moe.py): sigmoid router with `e_score_correction_bias`,
`n_group` / `topk_group` group limit, `norm_topk_prob`, `routed_scaling_factor`, plus `n_shared_experts` shared
experts. No sliding window (transformers uses none for this family).

Released checkpoints carry `num_nextn_predict_layers` multi-token-prediction layers, stored as layers
num_hidden_layers, num_hidden_layers + 1, ...: plain decoding does not use them, so `sanitize` drops them.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..errors import UnsupportedModelError
from .base import drop_extra_layers
from .grouped_moe import check_grouping, dense_or_grouped_mlp
from .moe import stack_experts
from .rope import initialize_rope
from .transformer import Attention, DecoderLayer, TransformerArgs, TransformerLM


@dataclass
class ModelArgs(TransformerArgs):
    """Glm4MoeConfig's fields and defaults (transformers 5 saves `num_local_experts` as n_routed_experts)."""

    model_type: str = "glm4_moe"
    rms_norm_eps: float = 1e-5
    num_key_value_heads: int | None = 8
    max_position_embeddings: int = 131072
    partial_rotary_factor: float | None = None
    attention_bias: bool = False
    use_qk_norm: bool = False
    moe_intermediate_size: int = 1408
    num_experts_per_tok: int = 8
    n_shared_experts: int | None = 1
    n_routed_experts: int = 128
    num_local_experts: int | None = None  # Glm4MoeConfig's alias of n_routed_experts
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 1
    norm_topk_prob: bool = True
    mlp_layer_types: list[str] | None = None  # not read by transformers 5.24; must agree if present

    def __post_init__(self):
        raw_rope = self.rope_scaling or self.rope_parameters or {}  # before super() standardizes rope_scaling
        super().__post_init__()
        if self.num_local_experts is not None:
            self.n_routed_experts = self.num_local_experts
        factor = raw_rope.get("partial_rotary_factor", self.partial_rotary_factor)
        self.partial_rotary_factor = 0.5 if factor is None else float(factor)
        self.rotary_dims = int(self.head_dim * self.partial_rotary_factor)
        sparse = [self.is_sparse(i) for i in range(self.num_hidden_layers)]
        if self.mlp_layer_types is not None and self.mlp_layer_types != ["sparse" if s else "dense" for s in sparse]:
            raise UnsupportedModelError(
                f"mlp_layer_types that differ from first_k_dense_replace {self.first_k_dense_replace} are not supported"
            )
        if any(sparse):
            check_grouping(self.n_routed_experts, self.num_experts_per_tok, self.n_group, self.topk_group)

    def is_sparse(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace


def make_attention(args: ModelArgs) -> Attention:
    rope = initialize_rope(
        args.rotary_dims, args.rope_base, False, args.rope_scaling, max_position_embeddings=args.max_position_embeddings
    )
    qk_norm = nn.RMSNorm if args.use_qk_norm else None
    return Attention(args, rope, bias=args.attention_bias, o_bias=False, qk_norm=qk_norm)


class Model(TransformerLM):
    def __init__(self, args: ModelArgs):
        layers = [
            DecoderLayer(args, make_attention(args), dense_or_grouped_mlp(args, i))
            for i in range(args.num_hidden_layers)
        ]
        super().__init__(args, layers)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Drop the MTP layers, stack the routed experts; without shared experts (n_shared_experts 0), drop the
        empty `shared_experts` tensors transformers saves."""
        weights = super().sanitize(drop_extra_layers(weights, self.args.num_hidden_layers))
        if not self.args.n_shared_experts:
            weights = {k: v for k, v in weights.items() if ".mlp.shared_experts." not in k}
        for i in range(self.args.num_hidden_layers):
            if self.args.is_sparse(i):
                weights = stack_experts(weights, f"model.layers.{i}.mlp", self.args.n_routed_experts)
        return weights
