"""On the CPU, an attention block's q, k and v projections as one product, and a gated MLP's gate and up projections
as one, of their float32 copies stacked (cpu_float32.py).

Why: a decode step on the CPU is mostly its products' memory reads and MLX's per-op costs (benchmarks/RESULTS.md,
"CPU: mlxcel's AVX2 kernel"). One product in place of three (two) drops three products' graph nodes and thread
fork-and-joins a layer, and the k and v products of a small model (192 x 576 for SmolLM2), each too small to be split
across threads, run inside a larger one. The queries' and keys' heads, side by side in the product, then rotate in one
call (without per-head norms between).

Exactness: where csrc/blas_rows.c computes MLX's float32 products (cpu_blas.py on a CPU with AVX2 and FMA), every
element of a product is one dot product computed the same way wherever its weight's row is, and blas_packed.c gives
the same bits from the packed values; so each slice of the stacked product is its own layer's product bit for bit,
its bias added as the layer adds it (tests/mlxcel_core/backends/test_cpu_fused.py). OpenBLAS's tiles round a column by
the product's width, so nothing is stacked there.

The stacked copy replaces the layers' own: each layer's float32 weight becomes a view of its rows, so the layers still
compute alone (as a model calling one directly does) and the copies cost no more memory. A 4- or 8-bit stack is tied
to its layers' packed values stacked likewise (cpu_blas.register_packed). `unprepare` swaps the blocks back and drops
the stacks (cpu_float32.unprepare calls it first, then drops the views).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..dequantize import is_quantized
from ..models.base import normed
from ..models.transformer import Attention, GatedMLP, heads_first
from .class_swaps import swap_back
from .cpu_float32 import PACKED_BITS, SWAPS, _Held, product

_swapped: dict[type, type] = {}  # a block's class -> its stacked subclass (made once a class)


class _Stack:
    """The stacked float32 weight (held outside the module's parameters, as cpu_float32's copies), the stacked biases
    (None: no layer has one), each layer's rows in it (start, end), and the output's dtype partner."""

    def __init__(self, layers: list[nn.Module]):
        self.held = _Held(mx.concatenate([layer.float32.weight for layer in layers], axis=0))
        self.bounds, start = [], 0
        for layer in layers:
            self.bounds.append((start, start + layer.float32.weight.shape[0]))
            start = self.bounds[-1][1]
        self.bias = mx.concatenate([layer["bias"] for layer in layers]) if "bias" in layers[0] else None
        if self.bias is not None:
            mx.eval(self.bias)
        self.like = _like(layers[0])

    def __call__(self, x: mx.array) -> mx.array:
        """The layers' outputs of x side by side, each as cpu_float32's product computes it."""
        return product(x, self.held.transposed, self.bias, self.like)

    def split(self, y: mx.array) -> list[mx.array]:
        return [y[..., start:end] for start, end in self.bounds]


class StackedAttention:
    def project(self, x: mx.array, norm: nn.Module | None = None) -> tuple[mx.array, mx.array, mx.array]:
        q, k, v = self.qkv_stack.split(self.qkv_stack(normed(x, norm)))
        return q, k, v


class StackedRotatedAttention(StackedAttention):
    def project_rotated(self, x: mx.array, norm: nn.Module | None, offset) -> tuple[mx.array, mx.array, mx.array]:
        """Attention.project_rotated's, the queries' and keys' heads rotated together in one call (a rotation of an
        element depends on its position and dimension only); with per-head norms, the plain method."""
        if self.qk_norm:
            return super().project_rotated(x, norm, offset)
        y, keys_end = self.qkv_stack(normed(x, norm)), self.qkv_stack.bounds[1][1]
        rotated = self.rope(heads_first(y[..., :keys_end], self.n_heads + self.n_kv_heads), offset)
        return rotated[:, : self.n_heads], rotated[:, self.n_heads :], heads_first(y[..., keys_end:], self.n_kv_heads)


class StackedGatedMLP:
    def project_gated(self, x: mx.array, norm: nn.Module | None = None) -> mx.array:
        gate, up = self.gate_up_stack.split(self.gate_up_stack(normed(x, norm)))
        return self.activation(gate, up)


BLOCKS = (  # (the plain block, the method the stack replaces, its layers' names, the stack's attribute, the mixin)
    (Attention, "project", ("q_proj", "k_proj", "v_proj"), "qkv_stack", StackedAttention),
    (GatedMLP, "project_gated", ("gate_proj", "up_proj"), "gate_up_stack", StackedGatedMLP),
)


def applies() -> bool:
    """Whether this process's float32 products are blas_rows.c's (cpu_blas.py on a CPU with AVX2 and FMA)."""
    from .. import cpu_blas

    return mx.default_device() == mx.cpu and cpu_blas._rows()


def _like(layer: nn.Module) -> mx.array:
    return layer["scales"] if is_quantized(layer) else layer["weight"]


def _stackable(block: nn.Module, names: tuple[str, ...]) -> bool:
    """Every layer a cpu_float32 layer of one kind and input width, with the same output dtype partner's type and
    bias's (or none), and a quantized stack's of one width and group size (so the packed values stack too)."""
    layers = [getattr(block, name, None) for name in names]
    if not all(type(layer) in SWAPS.values() and hasattr(layer, "float32") for layer in layers):
        return False
    first = layers[0]
    if any(type(layer) is not type(first) or _like(layer).dtype != _like(first).dtype for layer in layers):
        return False
    if len({layer.float32.weight.shape[1] for layer in layers}) != 1:
        return False
    if len({("bias" in layer, layer["bias"].dtype if "bias" in layer else None) for layer in layers}) != 1:
        return False  # (each has a bias of one dtype, or none has: a missing one is no zero's add)
    if is_quantized(first):
        return all((layer.bits, layer.group_size) == (first.bits, first.group_size) for layer in layers)
    return True


def _tie(stack: _Stack, layers: list[nn.Module]) -> bool:
    """Tie the stack to its layers' packed values (cpu_float32._tie_packed's check, over the stack)."""
    from .. import cpu_blas

    first = layers[0]
    if not is_quantized(first) or first.bits not in PACKED_BITS or first["weight"].ndim != 2:
        return False
    packed = mx.concatenate([layer["weight"] for layer in layers], axis=0)
    scales, biases = (
        mx.concatenate([layer[n] for layer in layers], axis=0).astype(mx.float32) for n in ("scales", "biases")
    )
    mx.eval(packed, scales, biases)
    return cpu_blas.register_packed(stack.held.weight, packed, scales, biases, first.group_size, first.bits)


def _stack(block: nn.Module, names: tuple[str, ...], attribute: str) -> None:
    layers = [getattr(block, name) for name in names]
    stack = _Stack(layers)
    mx.eval(stack.held.weight)
    stack.held.packed = _tie(stack, layers)
    for layer, (start, end) in zip(layers, stack.bounds):
        layer.float32 = _Held(stack.held.weight[start:end])  # (the old copy and its packed tie go)
    setattr(block, attribute, stack)


def _swap_class(plain: type, mixin: type) -> type:
    if plain not in _swapped:
        _swapped[plain] = type(f"Stacked{plain.__name__}", (mixin, plain), {})
    return _swapped[plain]


def prepare(model: nn.Module) -> int:
    """Stack the q/k/v projections of each attention block and the gate/up projections of each gated MLP whose class
    computes them with the plain block's method, where cpu_float32 took the layers; returns how many blocks."""
    count = 0
    for _, module in model.named_modules():
        for plain, method, names, attribute, mixin in BLOCKS:
            kind = type(module)
            if not isinstance(module, plain) or getattr(kind, method) is not getattr(plain, method):
                continue
            if not _stackable(module, names):
                continue
            _stack(module, names, attribute)
            if mixin is StackedAttention and kind.project_rotated is Attention.project_rotated:
                mixin = StackedRotatedAttention
            module.__class__ = _swap_class(kind, mixin)
            count += 1
    return count


def unprepare(model: nn.Module) -> int:
    """Undo `prepare` (cpu_float32.unprepare does, before its own); returns how many blocks."""

    def undo(module: nn.Module) -> None:
        for _, _, _, attribute, _ in BLOCKS:
            if attribute in module.__dict__:
                delattr(module, attribute)

    return swap_back(model, dict(_swapped), undo)
