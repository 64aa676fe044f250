"""Sparse mixture-of-experts pieces shared by the MoE families (Mixtral, Qwen3-MoE).

Experts are stacked: one [E, out, in] weight per projection, applied to each token's selected experts
with `mx.gather_mm` (`mx.gather_qmm` once quantized). Names follow mlx-lm (`switch_mlp.{gate,up,down}_proj`),
so checkpoints quantized by mlx-lm load as they are; `stack_experts` turns Hugging Face's per-expert
tensors (or transformers' fused `experts.gate_up_proj` / `experts.down_proj`) into that layout.
"""

from __future__ import annotations

import math
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from .activations import swiglu
from .base import normed

# Fewer routed (token, expert) pairs than this (decode): skip sorting tokens by expert.
SORT_THRESHOLD = 64


class SwitchLinear(nn.Module):
    """A bank of `num_experts` linear layers; `indices` [..., k] picks the experts for each input row."""

    def __init__(self, input_dims: int, output_dims: int, num_experts: int, bias: bool = False):
        super().__init__()
        scale = math.sqrt(1 / input_dims)
        self.weight = mx.random.uniform(-scale, scale, (num_experts, output_dims, input_dims))
        if bias:
            self.bias = mx.zeros((num_experts, output_dims))

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        x = mx.gather_mm(x, self.weight.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)
        if "bias" in self:
            x = x + mx.expand_dims(self.bias[indices], -2)
        return x

    def to_quantized(self, group_size: int | None = None, bits: int | None = None, mode: str = "affine", **_):
        return QuantizedSwitchLinear.from_switch_linear(self, group_size, bits, mode)


class QuantizedSwitchLinear(nn.Module):
    """SwitchLinear with packed weights + per-group scales/biases (affine), applied with `mx.gather_qmm`."""

    def __init__(
        self,
        input_dims: int,
        output_dims: int,
        num_experts: int,
        bias: bool = False,
        group_size: int | None = None,
        bits: int | None = None,
        mode: str = "affine",
    ):
        super().__init__()
        self.group_size = group_size or 64
        self.bits = bits or 4
        self.mode = mode
        scale = math.sqrt(1 / input_dims)
        weight = mx.random.uniform(-scale, scale, (num_experts, output_dims, input_dims))
        self.weight, self.scales, *biases = mx.quantize(weight, self.group_size, self.bits, mode=mode)
        if biases:
            self.biases = biases[0]
        if bias:
            self.bias = mx.zeros((num_experts, output_dims))
        self.freeze()

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        x = mx.gather_qmm(
            x,
            self["weight"],
            self["scales"],
            self.get("biases"),
            rhs_indices=indices,
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
            sorted_indices=sorted_indices,
        )
        if "bias" in self:
            x = x + mx.expand_dims(self.bias[indices], -2)
        return x

    @classmethod
    def from_switch_linear(
        cls, layer: SwitchLinear, group_size: int | None, bits: int | None, mode: str = "affine"
    ) -> "QuantizedSwitchLinear":
        num_experts, output_dims, input_dims = layer.weight.shape
        ql = cls(input_dims, output_dims, num_experts, "bias" in layer, group_size, bits, mode)
        ql.weight, ql.scales, *biases = mx.quantize(layer.weight, ql.group_size, ql.bits, mode=mode)
        if biases:
            ql.biases = biases[0]
        if "bias" in layer:
            ql.bias = layer.bias
        return ql


class SwitchGLU(nn.Module):
    """Gated expert MLPs: down(act(gate(x), up(x))) for each of a token's k experts; act is SwiGLU (silu(gate) * up)
    unless `activation` says otherwise (gpt-oss: its clamped SwiGLU), `bias`: each projection has a bias per expert."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        bias: bool = False,
        activation: Callable[[mx.array, mx.array], mx.array] = swiglu,
    ):
        super().__init__()
        self.gate_proj = SwitchLinear(hidden_size, intermediate_size, num_experts, bias=bias)
        self.up_proj = SwitchLinear(hidden_size, intermediate_size, num_experts, bias=bias)
        self.down_proj = SwitchLinear(intermediate_size, hidden_size, num_experts, bias=bias)
        self.activation = activation

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """x [..., D], indices [..., k] -> [..., k, D]."""
        lead, k = indices.shape[:-1], indices.shape[-1]
        x = mx.expand_dims(x, (-2, -3))  # [..., 1, 1, D]: one row per (token, expert) after gathering
        do_sort = indices.size >= SORT_THRESHOLD
        if do_sort:  # group rows by expert so each expert's weights are read once
            flat = indices.flatten()
            order = mx.argsort(flat)
            inverse = mx.argsort(order)
            x = x.reshape(-1, 1, x.shape[-1])[order // k]
            indices = flat[order]
        h = self.activation(self.gate_proj(x, indices, do_sort), self.up_proj(x, indices, do_sort))
        y = self.down_proj(h, indices, do_sort)
        if do_sort:
            y = y[inverse].reshape(*lead, k, 1, y.shape[-1])
        return y.squeeze(-2)


class SparseMoeBlock(nn.Module):
    """Router (linear -> softmax in fp32 -> top-k, optionally renormalized) over a bank of SwiGLU experts."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.switch_mlp = SwitchGLU(hidden_size, intermediate_size, num_experts)

    def __call__(self, x: mx.array, residual: mx.array | None = None, norm: nn.Module | None = None) -> mx.array:
        x = normed(x, norm)
        probs = mx.softmax(self.gate(x).astype(mx.float32), axis=-1)
        k = self.top_k
        indices = mx.stop_gradient(mx.argpartition(-probs, kth=k - 1, axis=-1)[..., :k])
        scores = mx.take_along_axis(probs, indices, axis=-1)
        if self.norm_topk_prob:
            scores = scores / scores.sum(axis=-1, keepdims=True)
        y = self.switch_mlp(x, indices)
        y = (y * scores[..., None].astype(y.dtype)).sum(axis=-2)
        return y if residual is None else residual + y


# Per-expert Hugging Face names -> our stacked projection, by naming scheme.
EXPERT_NAMES = {
    "qwen": {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"},
    "mixtral": {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"},
}


def stack_experts(
    weights: dict[str, mx.array], prefix: str, num_experts: int, scheme: str = "qwen"
) -> dict[str, mx.array]:
    """Rewrite `{prefix}.experts.*` into `{prefix}.switch_mlp.{gate,up,down}_proj.weight` ([E, out, in]).

    Accepts per-expert tensors (`{prefix}.experts.{i}.{name}.weight`, what transformers 5 still saves) and
    transformers' fused in-memory layout (`{prefix}.experts.gate_up_proj` [E, 2I, H], `.down_proj` [E, H, I]).
    Already-stacked weights (mlx-lm, or our own quantized output) pass through unchanged.
    """
    out_prefix = f"{prefix}.switch_mlp"
    fused = weights.pop(f"{prefix}.experts.gate_up_proj", None)
    if fused is not None:
        gate, up = fused.split(2, axis=1)  # the method: tensor-parallel loading's handles split unread too
        if isinstance(fused, mx.array):
            # Own copies, not views with the fused tensor's strides: on the H200 the fused-layout checkpoints' logits
            # were off by up to 3.6 while the same weights stacked per expert matched (suspected: MLX's CUDA
            # gather_mm over expert-sorted rows reads a strided expert bank wrong). One copy, at load.
            gate, up = mx.contiguous(gate), mx.contiguous(up)
        weights[f"{out_prefix}.gate_proj.weight"] = gate
        weights[f"{out_prefix}.up_proj.weight"] = up
        weights[f"{out_prefix}.down_proj.weight"] = weights.pop(f"{prefix}.experts.down_proj")
        return weights
    for hf_name, ours in EXPERT_NAMES[scheme].items():
        for suffix in ("weight", "scales", "biases", "bias"):
            keys = [f"{prefix}.experts.{e}.{hf_name}.{suffix}" for e in range(num_experts)]
            if all(key in weights for key in keys):  # else the loader names what is missing
                weights[f"{out_prefix}.{ours}.{suffix}"] = _stack([weights.pop(key) for key in keys])
    return weights


def _stack(parts: list) -> mx.array:
    """mx.stack, except that tensor-parallel loading's unread handles (loading/sliced.py) stack unread, so
    each rank later reads only its slice of every expert."""
    if all(isinstance(p, mx.array) for p in parts):
        return mx.stack(parts)
    return type(parts[0]).stack(parts)
