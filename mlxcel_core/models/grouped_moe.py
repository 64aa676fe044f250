"""Sigmoid-routed mixture of experts with grouped top-k selection and shared experts (GLM-4.5, DeepSeek-V3).

The router follows transformers' Glm4MoeTopkRouter (identical to DeepseekV3TopkRouter, DeepSeek's "noaux_tc"):
sigmoid scores of fp32 router logits; the per-expert `e_score_correction_bias` is added for choosing only; experts
fall into `n_group` groups, a group scores the sum of its two best biased scores, and only the `topk_group` best
groups stay eligible; the top `top_k` eligible experts are taken with their unbiased scores, renormalized
(`norm_topk_prob`) and multiplied by `routed_scaling_factor`. What differs from SparseMoeBlock (moe.py): sigmoid,
not softmax; the correction bias and group limit in the choice; the scaling; shared experts added to every token.

Checkpoint names are transformers' and mlx-lm's: `gate.weight` [E, hidden] and `gate.e_score_correction_bias` [E]
(the router is not a Linear, so quantization leaves it in its dtype, as mlx-lm does), the routed experts stacked as
`switch_mlp.{gate,up,down}_proj` (moe.stack_experts), the shared ones as the SwiGLU `shared_experts`.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..errors import UnsupportedModelError
from .base import normed
from .moe import SwitchGLU
from .transformer import GatedMLP


def check_grouping(num_experts: int, top_k: int, n_group: int, topk_group: int) -> None:
    """Raise UnsupportedModelError for a grouping transformers' router cannot compute either (it would fail on the
    group view or its top-2, or choose among masked-out experts)."""
    if n_group < 1 or num_experts % n_group:
        raise UnsupportedModelError(f"n_group {n_group} does not divide the {num_experts} routed experts")
    per_group = num_experts // n_group
    if per_group < 2:
        raise UnsupportedModelError(f"grouped routing needs at least 2 experts per group, n_group {n_group} gives 1")
    if not 1 <= topk_group <= n_group:
        raise UnsupportedModelError(f"topk_group {topk_group} is not between 1 and n_group {n_group}")
    if not 1 <= top_k <= topk_group * per_group:
        raise UnsupportedModelError(
            f"num_experts_per_tok {top_k} is more than the {topk_group * per_group} experts of topk_group groups"
        )


class GroupedTopKRouter(nn.Module):
    """Returns (indices [..., top_k], weights [..., top_k] fp32) for x [..., hidden]: see the module docstring."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        n_group: int = 1,
        topk_group: int = 1,
        norm_topk_prob: bool = True,
        routed_scaling_factor: float = 1.0,
    ):
        super().__init__()
        check_grouping(num_experts, top_k, n_group, topk_group)
        self.top_k = top_k
        self.n_group = n_group
        self.topk_group = topk_group
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor
        self.weight = mx.zeros((num_experts, hidden_size))
        self.e_score_correction_bias = mx.zeros((num_experts,))

    def eligible(self, choice: mx.array) -> mx.array:
        """`choice` with the experts outside the `topk_group` best groups set to -inf (a group's score: the sum of
        its two best choice scores)."""
        if self.topk_group == self.n_group:
            return choice  # every group stays
        groups = choice.reshape(*choice.shape[:-1], self.n_group, -1)
        group_scores = mx.topk(groups, 2, axis=-1).sum(axis=-1)
        n_drop = self.n_group - self.topk_group
        dropped = mx.argpartition(group_scores, kth=n_drop - 1, axis=-1)[..., :n_drop]
        groups = mx.put_along_axis(groups, dropped[..., None], mx.array(-mx.inf, dtype=choice.dtype), axis=-2)
        return groups.reshape(choice.shape)

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        # fp32 throughout, as transformers keeps the router (its weight and bias stay fp32 in a bf16 model)
        scores = mx.sigmoid(x.astype(mx.float32) @ self.weight.astype(mx.float32).T)
        choice = self.eligible(scores + self.e_score_correction_bias.astype(mx.float32))
        k = self.top_k
        indices = mx.stop_gradient(mx.argpartition(-choice, kth=k - 1, axis=-1)[..., :k])
        weights = mx.take_along_axis(scores, indices, axis=-1)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        return indices, weights * self.routed_scaling_factor


class GroupedMoeBlock(nn.Module):
    """GroupedTopKRouter over SwiGLU experts (`switch_mlp`), plus `n_shared_experts` shared SwiGLU experts
    (one MLP of n_shared_experts * intermediate_size, transformers' `shared_experts`) that every token goes through.
    With `residual`: residual + (routed + shared), transformers' order of the adds."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        *,
        n_group: int = 1,
        topk_group: int = 1,
        norm_topk_prob: bool = True,
        routed_scaling_factor: float = 1.0,
        n_shared_experts: int = 1,
    ):
        super().__init__()
        self.gate = GroupedTopKRouter(
            hidden_size, num_experts, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor
        )
        self.switch_mlp = SwitchGLU(hidden_size, intermediate_size, num_experts)
        self.has_shared = bool(n_shared_experts)
        if self.has_shared:
            self.shared_experts = GatedMLP(hidden_size, intermediate_size * n_shared_experts)

    def __call__(self, x: mx.array, residual: mx.array | None = None, norm: nn.Module | None = None) -> mx.array:
        x = normed(x, norm)
        indices, weights = self.gate(x)
        y = self.switch_mlp(x, indices)
        y = (y * weights[..., None]).sum(axis=-2).astype(y.dtype)
        if self.has_shared:
            y = y + self.shared_experts(x)
        return y if residual is None else residual + y


def dense_or_grouped_mlp(args, layer_idx: int) -> nn.Module:
    """Layer `layer_idx`'s feed-forward block in the DeepSeek-V3 layout (GLM-4.5 too): a GatedMLP of
    `intermediate_size` where `args.is_sparse(layer_idx)` is false (the first_k_dense_replace layers), else a
    GroupedMoeBlock from the args' routing fields."""
    if not args.is_sparse(layer_idx):
        return GatedMLP(args.hidden_size, args.intermediate_size)
    return GroupedMoeBlock(
        args.hidden_size,
        args.moe_intermediate_size,
        args.n_routed_experts,
        args.num_experts_per_tok,
        n_group=args.n_group,
        topk_group=args.topk_group,
        norm_topk_prob=args.norm_topk_prob,
        routed_scaling_factor=args.routed_scaling_factor,
        n_shared_experts=args.n_shared_experts,
    )
