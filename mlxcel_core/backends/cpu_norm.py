"""RMS norms on the CPU as one compiled MLX function.

Why: MLX's CPU backend runs `mx.fast.rms_norm` as its fallback graph, about ten ops a call (the square, the sum, the
mean, the epsilon, the reciprocal root, the products and their broadcasts); a decode step of a 30-layer model runs 61
of them, and on a CPU such a step is mostly per-op costs (benchmarks/RESULTS.md, "CPU: mlxcel's AVX2 kernel").
Compiled, MLX fuses the ops after the sum into one generated kernel: three graph nodes a call.

Exactness: the fused kernel computes the same operations in the same order and types. MLX builds it with its own
compiler command, which on x86-64 targets no fused multiply-add, so nothing is contracted; elsewhere it could be. So
`prepare` first checks, once a process and dtype, that the compiled norm equals mx.fast.rms_norm bit for bit on a
probe (a thousand rows of widely scaled values) in float32 and in its norms' dtype, and swaps nothing where it does not
(tests/mlxcel_core/backends/test_cpu_norm.py).
"""

from __future__ import annotations

import functools

import mlx.core as mx
import mlx.nn as nn

from .class_swaps import swap_back

PROBE_ROWS = 512


@functools.partial(mx.compile, shapeless=False)
def _norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    return mx.fast.rms_norm(x, weight, eps)


class CompiledRMSNorm(nn.RMSNorm):
    def __call__(self, x: mx.array) -> mx.array:
        return _norm(x, self["weight"], self.eps)


@functools.cache
def exact(x_dtype=mx.float32, weight_dtype=mx.float32) -> bool:
    """Whether the compiled norm gives mx.fast.rms_norm's bits on this machine for x and weights of these dtypes
    (checked once a process and pair: the first check compiles the kernels the model's own norms then use)."""
    key = mx.random.key(7)
    for width in (64, 1000):
        k1, k2, k3, key = mx.random.split(key, 4)
        spread = mx.exp(mx.random.uniform(-6, 6, (PROBE_ROWS, 1), key=k1))
        x = (mx.random.normal((PROBE_ROWS, width), key=k2) * spread).astype(x_dtype)
        weight = mx.random.normal((width,), key=k3).astype(weight_dtype)
        if not mx.array_equal(_norm(x, weight, 1e-6), mx.fast.rms_norm(x, weight, 1e-6)).item():
            return False
    return True


def applies() -> bool:
    """Whether this process computes on the CPU (where mx.fast.rms_norm is its fallback graph)."""
    return mx.default_device() == mx.cpu


def prepare(model: nn.Module) -> int:
    """Swap the model's nn.RMSNorm modules for the compiled one where it is exact for x in their weights' dtype or in
    float32 (the activations' dtype is one of the two); returns how many."""
    norms = [m for _, m in model.named_modules() if type(m) is nn.RMSNorm]
    weights = {m["weight"].dtype for m in norms}
    if not all(exact(x, w) for w in weights for x in {w, mx.float32}):
        return 0
    for module in norms:
        module.__class__ = CompiledRMSNorm
    return len(norms)


def unprepare(model: nn.Module) -> int:
    """Undo `prepare`; returns how many."""
    return swap_back(model, {nn.RMSNorm: CompiledRMSNorm})
