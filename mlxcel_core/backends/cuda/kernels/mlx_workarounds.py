"""Where MLX's CUDA backend computes wrong, route around it at load.

MLX 0.32.4's CUDA `quantized_matmul` with K (a layer's input size) equal to the group size hangs in bf16 and hangs or
returns garbage in float32 once x has two or more rows (measured on the H200 at K = group size = 64; K = 64 with
group 32, and K = 128 with group 64, are right: benchmarks/RESULTS.md). No released model is that narrow, but a
quantized tiny one is, and it must not hang. On CUDA such layers (and a quantized embedding serving as a tied LM head)
change class at load, as kernels/fast_linear.py's swap does: their parameters stay packed, and their products use the
dequantized weight, the values quantized_matmul would use. MoE expert banks (`gather_qmm`) are left as they are: not
measured.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def _dequantized_weight(layer: nn.Module) -> mx.array:
    return mx.dequantize(layer["weight"], layer["scales"], layer.get("biases"), layer.group_size, layer.bits)


class OneGroupQuantizedLinear(nn.QuantizedLinear):
    """A QuantizedLinear whose input is one group: x @ dequantize(W).T instead of quantized_matmul."""

    def __call__(self, x: mx.array) -> mx.array:
        y = x @ _dequantized_weight(self).T
        return y + self["bias"] if "bias" in self else y


class OneGroupQuantizedEmbedding(nn.QuantizedEmbedding):
    """A QuantizedEmbedding one group wide: its `as_linear` (a tied LM head) on the dequantized table."""

    def as_linear(self, x: mx.array) -> mx.array:
        return x @ _dequantized_weight(self).T


_SWAPS = {nn.QuantizedLinear: OneGroupQuantizedLinear, nn.QuantizedEmbedding: OneGroupQuantizedEmbedding}


def hits_qmm_fault(module: nn.Module) -> bool:
    """An affine QuantizedLinear / QuantizedEmbedding (exactly those classes) whose input size is its group size."""
    if type(module) not in _SWAPS or getattr(module, "mode", "affine") != "affine":
        return False
    return module["weight"].shape[-1] * 32 // module.bits == module.group_size


def route_around_qmm_fault(model: nn.Module) -> int:
    """Swap every layer `hits_qmm_fault` picks to its one-group class; return how many (unconditional: callers gate).
    The decode kernels' swaps and the projection fusion then pass these layers by (they match exact classes)."""
    count = 0
    for _, module in model.named_modules():
        if hits_qmm_fault(module):
            module.__class__ = _SWAPS[type(module)]
            count += 1
    return count
