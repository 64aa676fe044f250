"""Quantized and half-precision layers computed as float32 products on the CPU, where MLX's float32 products run on
cpu_blas.py's kernel (or OpenBLAS).

Why: with cpu_blas.py in place MLX's float32 matmul runs at tens of GFLOP/s on the CPU, while its quantized and
bfloat16/float16 matmuls stay near 2 GFLOP/s (benchmarks/RESULTS.md, "CPU: MLX's float32 products through OpenBLAS").
So on the CPU the portable backend's `prepare_model` gives each nn.QuantizedLinear and nn.Linear / nn.Embedding
holding bfloat16 or float16 weights (exactly those classes: sharded and expert layers keep theirs) a float32 copy of
its (dequantized) weight and computes `x @ w.T` with it; an embedding gets one only where the model ties its output
projection to it (`as_linear`: the lookup itself reads the layer's own weight). The layers keep their class's
parameters (a subclass swapped in by `__class__`), so saving, converting, requantizing and `isinstance` checks see the
model as it was; `unprepare` swaps them back and drops the copies.

The copies cost 4 bytes a weight: a model takes them only while they fit in FLOAT32_SHARE of the machine's memory
(a larger model keeps MLX's own kernels). A 4- or 8-bit layer's copy is also tied to its packed values
(cpu_blas.register_packed, csrc/blas_packed.c): products of a few rows then read those, an eighth or a quarter of the
bytes, with the same bits (every weight checked when tied), for another eighth or quarter of the copy's memory.
The product is of the checkpoint's own values in float32 (a quantized weight dequantized in float32 from its stored
scales and biases), as MLX's CPU kernels compute for a float32 x, in another summation order; a half-precision layer's
output is rounded to its dtype as before.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..dequantize import is_quantized
from ..engine.budget import device_memory_bytes
from .class_swaps import swap_back

FLOAT32_SHARE = 0.25  # of physical memory, at most, for the float32 copies


class _Held:
    """The float32 weight, held outside the module's parameters (nn.Module keeps arrays it is given as parameters);
    `packed`: whether cpu_blas.py computes its products from the layer's packed values (untied when this goes)."""

    def __init__(self, weight: mx.array):
        self.weight = weight
        self.transposed = weight.T  # (a view, made once: a step's graph then has no transpose a product)
        mx.eval(self.transposed)
        self.packed = False

    def __del__(self):
        if self.packed:
            try:
                _untie(self.weight)
            except ImportError:  # (the interpreter is shutting down: the process's memory goes with it)
                pass


def _untie(weight: mx.array) -> None:
    from .. import cpu_blas

    cpu_blas.unregister_packed(weight)


def product(x: mx.array, transposed: mx.array, bias: mx.array | None, like: mx.array) -> mx.array:
    """`x @ w.T` (+ bias) with a float32 weight's transpose, in the dtype the layer's own kernel would give (x's and
    `like`'s: its scales or weight); cpu_fused.py's stacks compute theirs here too."""
    y = x.astype(mx.float32) @ transposed
    if bias is not None:
        y = y + bias
    return y.astype(mx.result_type(x, like))


def _product(layer: nn.Module, x: mx.array, like: mx.array) -> mx.array:
    return product(x, layer.float32.transposed, layer["bias"] if "bias" in layer else None, like)


class Float32QuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x: mx.array) -> mx.array:
        return _product(self, x, self["scales"])


class Float32QuantizedEmbedding(nn.QuantizedEmbedding):
    def as_linear(self, x: mx.array) -> mx.array:
        return _product(self, x, self["scales"])


class Float32Linear(nn.Linear):
    def __call__(self, x: mx.array) -> mx.array:
        return _product(self, x, self["weight"])


class Float32Embedding(nn.Embedding):
    def as_linear(self, x: mx.array) -> mx.array:
        return _product(self, x, self["weight"])


SWAPS = {
    nn.QuantizedLinear: Float32QuantizedLinear,
    nn.QuantizedEmbedding: Float32QuantizedEmbedding,
    nn.Linear: Float32Linear,
    nn.Embedding: Float32Embedding,
}
HALF = (mx.bfloat16, mx.float16)
PACKED_BITS = (4, 8)  # widths csrc/blas_packed.c reads


def applies() -> bool:
    """Whether this process computes on the CPU with MLX's float32 products taken over by cpu_blas.py."""
    from .. import cpu_blas

    return mx.default_device() == mx.cpu and cpu_blas.active()


def _takes(model: nn.Module, layer: nn.Module) -> bool:
    kind = type(layer)
    if kind not in SWAPS:
        return False
    quantized = is_quantized(layer)
    if quantized and getattr(layer, "mode", "affine") != "affine":
        return False
    if not quantized and layer["weight"].dtype not in HALF:  # (float32 weights are cpu_blas.py's already)
        return False
    if kind in (nn.Embedding, nn.QuantizedEmbedding):  # only a tied output projection reads it as a product
        return getattr(getattr(model, "args", None), "tie_word_embeddings", True) is not False
    return True


def _float32_bytes(layer: nn.Module) -> int:
    size = layer["weight"].size
    return 4 * (size * 32 // layer.bits if is_quantized(layer) else size)


def _float32_weight(layer: nn.Module) -> mx.array:
    """The layer's weight in float32; a quantized one dequantized from float32 copies of its scales and biases: the
    values MLX's CPU kernel multiplies by a float32 x (half-precision scales would round each weight to their dtype
    first). The layers taken are affine (`_takes`), so they have biases; they are unpacked by MLX ops, which give
    mx.dequantize's values bit for bit and run faster than MLX's CPU dequantize at every width."""
    if not is_quantized(layer):
        return layer["weight"].astype(mx.float32)
    scales = layer["scales"].astype(mx.float32)
    biases = layer["biases"].astype(mx.float32)
    q = _unpacked(layer["weight"], layer.bits).astype(mx.float32)
    q = q.reshape(*q.shape[:-1], -1, layer.group_size)
    return (q * scales[..., None] + biases[..., None]).reshape(*q.shape[:-2], -1)


def _unpacked(w: mx.array, bits: int) -> mx.array:
    """The values MLX packs into `w` (a little-endian bit stream, value j at bits [j*bits, (j+1)*bits)), as uint8."""
    by = w.view(mx.uint8)
    mask = (1 << bits) - 1
    if bits == 8:
        return by
    if bits in (2, 4):  # whole values a byte
        fields = [(by >> shift) & mask for shift in range(0, 8, bits)]
        return mx.stack(fields, axis=-1).reshape(*w.shape[:-1], -1)
    by = by.reshape(*w.shape[:-1], -1, bits)  # 3, 5 and 6 bits: 8 values in `bits` bytes
    wide = by.astype(mx.uint16)
    values = []
    for i in range(8):
        byte, shift = divmod(bits * i, 8)
        if shift + bits > 8:  # (the value runs into the next byte: the two read as one uint16)
            values.append((((wide[..., byte] | (wide[..., byte + 1] << 8)) >> shift) & mask).astype(mx.uint8))
        else:
            values.append((by[..., byte] >> shift) & mask)
    return mx.stack(values, axis=-1).reshape(*w.shape[:-1], -1)


def prepare(model: nn.Module) -> int:
    """Swap the model's quantized and half-precision layers for their float32-product classes when the copies fit;
    returns how many."""
    layers = [m for _, m in model.named_modules() if _takes(model, m)]
    need = sum(_float32_bytes(m) for m in layers)
    if not layers or need > FLOAT32_SHARE * device_memory_bytes():
        return 0
    for layer in layers:
        layer.float32 = _Held(_float32_weight(layer))
        mx.eval(layer.float32.weight)
        layer.float32.packed = _tie_packed(layer)
        layer.__class__ = SWAPS[type(layer)]
    return len(layers)


def _tie_packed(layer: nn.Module) -> bool:
    """Let the products of a 4- or 8-bit layer read its packed values rather than the float32 copy (a decode step then
    reads an eighth or a quarter of the bytes; cpu_blas.register_packed checks that every weight is the copy's value
    bit for bit, so the products are the same)."""
    from .. import cpu_blas

    if not is_quantized(layer) or layer.bits not in PACKED_BITS or layer["weight"].ndim != 2:
        return False
    scales, biases = (layer[name].astype(mx.float32) for name in ("scales", "biases"))
    mx.eval(scales, biases)
    weight = layer.float32.weight
    return cpu_blas.register_packed(weight, layer["weight"], scales, biases, layer.group_size, layer.bits)


def unprepare(model: nn.Module) -> int:
    """Undo `prepare`: MLX's quantized classes again, the float32 copies dropped (and first the blocks that stack
    them, cpu_fused.py); returns how many."""
    from . import cpu_fused

    cpu_fused.unprepare(model)
    return swap_back(model, SWAPS, lambda module: delattr(module, "float32"))
