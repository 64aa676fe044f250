"""Not product code: what handing the CPU projections to numpy's BLAS would give. Every QuantizedLinear of the loaded
model (and a tied embedding's output projection) becomes a module holding its dequantized float32 weight as a numpy
array; a call evaluates x, multiplies with numpy (float32) and wraps the result. Then any mlxcel command runs:

    python benchmarks/archive/2026-12-02-llama-cpp-peer/blas_probe.py bench -m FILE -p 64 -n 32 -r 3
    python benchmarks/archive/2026-12-02-llama-cpp-peer/blas_probe.py generate -m FILE -p "..." --temp 0 --json

With MLXCEL_PROBE_BLAS=0 the swap is off (the plain path, for the same commands).
"""

import os
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np

import mlxcel_core.backends.base as base


class BlasLinear(nn.Module):
    def __init__(self, q: nn.QuantizedLinear):
        super().__init__()
        w = mx.dequantize(q.weight, q.scales, q.biases, q.group_size, q.bits).astype(mx.float32)
        self._w_t = np.ascontiguousarray(np.array(w).T)  # [in, out]
        self._bias = np.array(q["bias"].astype(mx.float32)) if "bias" in q else None

    def __call__(self, x):
        mx.eval(x)
        xn = np.array(x.astype(mx.float32), copy=False).reshape(-1, self._w_t.shape[0])
        y = xn @ self._w_t
        if self._bias is not None:
            y += self._bias
        return mx.array(y.reshape(*x.shape[:-1], self._w_t.shape[1])).astype(x.dtype)


class BlasEmbedding(nn.Module):
    def __init__(self, e: nn.QuantizedEmbedding):
        super().__init__()
        self.inner = e
        self.head = BlasLinear(e)

    def __call__(self, ids):
        return self.inner(ids)

    def as_linear(self, x):
        return self.head(x)


def prepare(self, model) -> None:
    swaps = []
    for path, module in model.named_modules():
        for name, child in module.children().items():
            if isinstance(child, nn.QuantizedLinear):
                swaps.append((module, name, BlasLinear(child)))
            elif isinstance(child, nn.QuantizedEmbedding):
                swaps.append((module, name, BlasEmbedding(child)))
    for module, name, new in swaps:
        setattr(module, name, new)


if os.environ.get("MLXCEL_PROBE_BLAS", "1") != "0":
    base.Backend.prepare_model = prepare

from mlxcel_cli.main import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
