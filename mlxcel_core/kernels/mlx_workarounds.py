"""Where MLX's CUDA backend computes wrong, route around it at load.

MLX 0.32.4's CUDA `quantized_matmul` with K (a layer's input size) equal to the group size hangs in bf16 and hangs or
returns garbage in float32 once x has two or more rows (measured on the H200 at K = group size = 64; K = 64 with
group 32, and K = 128 with group 64, are right: benchmarks/RESULTS.md). No released model is that narrow, but a
quantized tiny one is, and it must not hang: on CUDA such layers (and a quantized embedding that serves as a tied LM
head) are dequantized once into their 16-bit/float32 counterparts, the same values the quantized matmul would use.
MoE expert banks (`gather_qmm`) are left as they are: not measured.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path


def hits_qmm_fault(module: nn.Module) -> bool:
    """An affine QuantizedLinear / QuantizedEmbedding (exactly those classes) whose input size is its group size."""
    if type(module) not in (nn.QuantizedLinear, nn.QuantizedEmbedding) or getattr(module, "mode", "affine") != "affine":
        return False
    return module["weight"].shape[-1] * 32 // module.bits == module.group_size


def dequantized(module: nn.Module) -> nn.Module:
    """The plain layer with `module`'s dequantized weight (and its bias)."""
    weight = mx.dequantize(module["weight"], module["scales"], module.get("biases"), module.group_size, module.bits)
    rows, cols = weight.shape
    if isinstance(module, nn.QuantizedEmbedding):
        plain = nn.Embedding(rows, cols)
    else:
        plain = nn.Linear(cols, rows, bias="bias" in module)
        if "bias" in module:
            plain.bias = module["bias"]
    plain.weight = weight
    return plain


def dequantize_faulty_layers(model: nn.Module) -> int:
    """Replace every layer `hits_qmm_fault` picks by `dequantized`; return how many (unconditional: callers gate)."""
    count = 0

    def swap(_, module):
        nonlocal count
        if hits_qmm_fault(module):
            count += 1
            return dequantized(module)
        return module

    model.update_modules(tree_map_with_path(swap, model.leaf_modules(), is_leaf=nn.Module.is_module))
    return count
