"""Quantized layers back to their float form: `mlxcel convert --dequantize` and LoRA fused onto a quantized base.

A layer's dequantized weight is exactly what its quantized kernels compute with (`mx.dequantize` of its packed
weight, scales and biases), in the dtype of its scales, so the float layer computes the same function.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .errors import UnsupportedModelError
from .models.moe import QuantizedSwitchLinear, SwitchLinear


def is_quantized(module: nn.Module) -> bool:
    """A layer that holds packed weights (MLX's quantized Linear and Embedding, the quantized expert banks)."""
    return isinstance(module, nn.Module) and "scales" in module and hasattr(module, "bits")


def dequantized_weight(module: nn.Module) -> mx.array:
    return mx.dequantize(
        module.weight,
        module.scales,
        module.get("biases"),
        group_size=module.group_size,
        bits=module.bits,
        mode=getattr(module, "mode", "affine"),
    )


def dequantized_layer(module: nn.Module, weight: mx.array | None = None) -> nn.Module:
    """The float layer of the quantized `module`, with `weight` (default: its dequantized weight)."""
    weight = dequantized_weight(module) if weight is None else weight
    has_bias = "bias" in module
    if isinstance(module, nn.QuantizedLinear):
        layer = nn.Linear(1, 1, bias=has_bias)
    elif isinstance(module, nn.QuantizedEmbedding):
        layer = nn.Embedding(1, 1)
    elif isinstance(module, QuantizedSwitchLinear):
        layer = SwitchLinear(1, 1, 1, bias=has_bias)
    else:
        raise UnsupportedModelError(f"cannot dequantize a {type(module).__name__} layer")
    layer.weight = weight
    if has_bias:
        layer.bias = module.bias
    return layer


def dequantize_model(model: nn.Module) -> int:
    """Replace every quantized layer of `model` by its float form, in place; the number of layers replaced."""
    from mlx.utils import tree_unflatten

    replaced = [(name, dequantized_layer(m)) for name, m in model.named_modules() if is_quantized(m)]
    if replaced:
        model.update_modules(tree_unflatten(replaced))
    return len(replaced)
