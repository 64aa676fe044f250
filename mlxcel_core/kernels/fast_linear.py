"""Decode GEMVs of 4-bit layers on the CUDA kernel (kernels/qmv.py): a class swap on a built model.

    maybe_use_fast_quantized_linear(model)   # load_model / build_random_model call this once the model is built

Plain ``nn.QuantizedLinear`` layers (exact type: tensor-parallel subclasses such as RowParallelQuantizedLinear
keep their own __call__) that the kernel can run (4-bit affine, group size 32/64/128, K a multiple of 32) become
`FastQuantizedLinear`, and plain ``nn.QuantizedEmbedding`` layers `FastQuantizedEmbedding` (whose ``as_linear`` is
the tied LM head). Only the class changes, as distributed/shard.py does: parameters, names and isinstance checks
stay those of MLX's classes. An input with at most MAX_ROWS rows (decode) goes through `quantized_matvec`, more
(prefill) through ``mx.quantized_matmul`` as before.

Gate: on only when MLX runs on CUDA and MLXCEL_QMV is not "0". The default is still "0" (off) until the kernel
has been validated on the H200 (tests/mlxcel_core/kernels, benchmarks/qmv.py); then DEFAULT_QMV becomes "1".
"""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn

from . import qmv

ENV = "MLXCEL_QMV"
DEFAULT_QMV = "0"  # off until validated on the device; flip to "1" to make it the default on CUDA


def enabled() -> bool:
    """Whether loaded models get the fast layers: MLX on CUDA and MLXCEL_QMV (default DEFAULT_QMV) not "0"."""
    return os.environ.get(ENV, DEFAULT_QMV).strip() != "0" and qmv.cuda_kernel_available()


def _layer_supported(layer: nn.Module) -> bool:
    """The layer's own operands suit the kernel (checked once, at the swap; a call then checks only x)."""
    weight, scales, biases = layer["weight"], layer["scales"], layer.get("biases")
    if getattr(layer, "mode", "affine") != "affine" or biases is None or weight.ndim != 2:
        return False
    k = weight.shape[1] * 32 // layer.bits
    return qmv.shape_supported((1, k), mx.float32, weight.shape, weight.dtype, scales.shape, scales.dtype,
                               biases.shape, biases.dtype, layer.group_size, layer.bits)


def _kernel_takes(x: mx.array) -> bool:
    """Decode-sized x (1..MAX_ROWS rows) of a float type, on the CUDA device."""
    return x.size <= qmv.MAX_ROWS * x.shape[-1] and x.size > 0 and x.dtype in qmv.FLOAT_TYPES and qmv.kernel_ready()


class FastQuantizedLinear(nn.QuantizedLinear):
    """nn.QuantizedLinear whose decode calls (<= MAX_ROWS rows of x) run the 4-bit CUDA matvec kernel."""

    def __call__(self, x: mx.array) -> mx.array:
        if not _kernel_takes(x):
            return super().__call__(x)
        y = qmv.cuda_quantized_matvec(x, self["weight"], self["scales"], self["biases"], self.group_size)
        return y + self["bias"] if "bias" in self else y


class FastQuantizedEmbedding(nn.QuantizedEmbedding):
    """nn.QuantizedEmbedding whose `as_linear` (a tied LM head) runs the kernel for decode."""

    def as_linear(self, x: mx.array) -> mx.array:
        if not _kernel_takes(x):
            return super().as_linear(x)
        return qmv.cuda_quantized_matvec(x, self["weight"], self["scales"], self["biases"], self.group_size)


_SWAPS = {nn.QuantizedLinear: FastQuantizedLinear, nn.QuantizedEmbedding: FastQuantizedEmbedding}
_RESTORES = {fast: plain for plain, fast in _SWAPS.items()}


def use_fast_quantized_linear(model: nn.Module) -> int:
    """Swap every plain nn.QuantizedLinear / nn.QuantizedEmbedding the kernel supports; return how many.

    Unconditional (no backend or env check): on a backend without the kernel the fast layers compute exactly
    what MLX's do, through mx.quantized_matmul."""
    swapped = 0
    for _, module in model.named_modules():
        fast = _SWAPS.get(type(module))
        if fast is not None and _layer_supported(module):
            module.__class__ = fast
            swapped += 1
    return swapped


def restore_quantized_linear(model: nn.Module) -> int:
    """Undo `use_fast_quantized_linear`: the fast layers become MLX's classes again; return how many."""
    restored = 0
    for _, module in model.named_modules():
        plain = _RESTORES.get(type(module))
        if plain is not None:
            module.__class__ = plain
            restored += 1
    return restored


def maybe_use_fast_quantized_linear(model: nn.Module) -> int:
    """`use_fast_quantized_linear` when `enabled()` (MLX on CUDA and MLXCEL_QMV not "0"), else nothing."""
    return use_fast_quantized_linear(model) if enabled() else 0
