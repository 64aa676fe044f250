"""Where MLX's CUDA backend computes wrong, route around it at load.

MLX 0.32.4's CUDA `quantized_matmul` with K (a layer's input size) equal to the group size hangs in bf16 and hangs or
returns garbage in float32 once x has two or more rows (measured on the H200 at K = group size = 64; K = 64 with
group 32, and K = 128 with group 64, are right: benchmarks/RESULTS.md). No released model is that narrow, but a
quantized tiny one is, and it must not hang. On CUDA such layers (and a quantized embedding serving as a tied LM head)
change class at load, as kernels/fast_linear.py's swap does: their parameters stay packed, and their products use the
dequantized weight, the values quantized_matmul would use.

MLX 0.32.4's CUDA `gather_mm` told its rows are sorted by expert (`sorted_indices=True`, the MoE prefill's grouping
after an `argsort` on the GPU) now and then returns other values for the same inputs: a tiny gpt-oss forward of 80
tokens gave other logits (by up to 0.9) in 2-6 of 120-150 repeats, and in none with the same sorted rows passed as
unsorted, or with the argsort on the CPU (benchmarks/archive/2026-12-02-gather-mm-race/). The hint selects MLX's
grouped-GEMM path (one row per token, sorted: CUTLASS grouped GEMM over per-expert segments); without it each row is
its own matrix-vector product, which reads an expert's weights once per row instead of once per segment. On CUDA,
float expert banks change class at load to one that never passes the hint; the rows are still grouped, the products
the same. Quantized banks (`gather_qmm`) keep it: MLX's CUDA gather_qmm does not read the hint (its source, 0.32.2).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlxcel_core.models.moe import SwitchLinear


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


class UnsortedHintSwitchLinear(SwitchLinear):
    """A float expert bank whose `gather_mm` never gets the sorted-rows hint (its rows may still come sorted)."""

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        return super().__call__(x, indices, sorted_indices=False)


def route_around_sorted_gather_race(model: nn.Module) -> int:
    """Swap every float expert bank (exactly SwitchLinear) to UnsortedHintSwitchLinear; return how many
    (unconditional: callers gate). Its parameters and their names stay as they are."""
    count = 0
    for _, module in model.named_modules():
        if type(module) is SwitchLinear:
            module.__class__ = UnsortedHintSwitchLinear
            count += 1
    return count
