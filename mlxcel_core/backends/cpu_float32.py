"""Quantized layers computed as float32 products on the CPU, where MLX's float32 products run on OpenBLAS.

Why: with cpu_blas.py in place MLX's float32 matmul runs at tens of GFLOP/s on the CPU, while its quantized matmul
stays near 2 GFLOP/s (benchmarks/RESULTS.md, "CPU: MLX's float32 products through OpenBLAS"). So on the CPU the
portable backend's `prepare_model` gives each nn.QuantizedLinear and nn.QuantizedEmbedding (exactly those classes:
sharded and expert layers keep theirs) a float32 copy of its dequantized weight and computes `x @ w.T` with it.
The layers keep their class's parameters (a subclass swapped in by `__class__`), so saving, converting,
requantizing and `isinstance` checks see the quantized model; `unprepare` swaps them back and drops the copies.

The copies cost 4 bytes a weight: a model takes them only while they fit in FLOAT32_SHARE of the machine's memory
(a larger model keeps MLX's quantized kernels). The product is the dequantized weight's (the checkpoint's own
values) in float32, as MLX's CPU quantized kernel computes, in another summation order.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..dequantize import dequantized_weight
from ..engine.budget import device_memory_bytes

FLOAT32_SHARE = 0.25  # of physical memory, at most, for the float32 copies


class _Held:
    """The float32 weight, held outside the module's parameters (nn.Module keeps arrays it is given as parameters)."""

    def __init__(self, weight: mx.array):
        self.weight = weight


class Float32QuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x: mx.array) -> mx.array:
        dtype = mx.result_type(x, self["scales"])
        y = x.astype(mx.float32) @ self.float32.weight.T
        if "bias" in self:
            y = y + self["bias"]
        return y.astype(dtype)


class Float32QuantizedEmbedding(nn.QuantizedEmbedding):
    def as_linear(self, x: mx.array) -> mx.array:
        dtype = mx.result_type(x, self["scales"])
        return (x.astype(mx.float32) @ self.float32.weight.T).astype(dtype)


SWAPS = {nn.QuantizedLinear: Float32QuantizedLinear, nn.QuantizedEmbedding: Float32QuantizedEmbedding}


def applies() -> bool:
    """Whether this process computes on the CPU with MLX's float32 products on OpenBLAS."""
    from .. import cpu_blas

    return mx.default_device() == mx.cpu and cpu_blas.status().startswith("openblas")


def prepare(model: nn.Module) -> int:
    """Swap the model's quantized layers for their float32-product classes when the copies fit; returns how many."""
    layers = [m for _, m in model.named_modules() if type(m) in SWAPS and getattr(m, "mode", "affine") == "affine"]
    need = sum(4 * (m["weight"].size * 32 // m.bits) for m in layers)  # float32 bytes of the dequantized weights
    if not layers or need > FLOAT32_SHARE * device_memory_bytes():
        return 0
    for layer in layers:
        layer.float32 = _Held(dequantized_weight(layer).astype(mx.float32))
        mx.eval(layer.float32.weight)
        layer.__class__ = SWAPS[type(layer)]
    return len(layers)


def unprepare(model: nn.Module) -> int:
    """Undo `prepare`: MLX's quantized classes again, the float32 copies dropped; returns how many."""
    plain = {fast: slow for slow, fast in SWAPS.items()}
    restored = 0
    for _, module in model.named_modules():
        if type(module) in plain:
            module.__class__ = plain[type(module)]
            del module.float32
            restored += 1
    return restored
