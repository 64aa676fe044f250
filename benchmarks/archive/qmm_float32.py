"""Probe: how exactly MLX's quantized products compute when the product's dtype is float32 (float32 scales or x).

For each case: the largest |quantized_matmul - x @ dequantize(w).T| over the largest |x @ dequantize(w).T|, the
reference computed in float64 with numpy, or the error MLX raises. Run on the H200:
    python benchmarks/archive/qmm_float32.py
"""

from __future__ import annotations

import itertools
import os

os.environ.setdefault("MLX_ENABLE_TF32", "0")  # (as mlxcel sets it: the dense column is then true float32)

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402


def _case(m: int, n: int, k: int, bits: int, group: int, x_dtype, s_dtype, batch: int = 0) -> str:
    rng = np.random.default_rng(0)
    shape = (batch, n, k) if batch else (n, k)
    w = mx.array(rng.standard_normal(shape).astype(np.float32))
    wq, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    scales, biases = scales.astype(s_dtype), biases.astype(s_dtype)
    deq = np.array(mx.dequantize(wq, scales, biases, group_size=group, bits=bits).astype(mx.float32), np.float64)
    x = mx.array(rng.standard_normal((batch, m, k) if batch else (m, k)).astype(np.float32)).astype(x_dtype)
    ref = np.array(x.astype(mx.float32), np.float64) @ np.swapaxes(deq, -1, -2)
    try:
        got = mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=group, bits=bits)
        got = np.array(got.astype(mx.float32), np.float64)
    except (RuntimeError, ValueError) as err:
        return f"error: {str(err)[:90]}"
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    dense = np.array(x.astype(mx.float32) @ mx.swapaxes(mx.array(deq.astype(np.float32)), -1, -2), np.float64)
    return f"rel {rel:.1e}  (dense float32 matmul {np.abs(dense - ref).max() / np.abs(ref).max():.1e})"


def main() -> None:
    print("device", mx.default_device(), "mlx", mx.__version__)
    f32, f16, bf16 = mx.float32, mx.float16, mx.bfloat16
    for (xd, sd), m, (n, k), bits, group in itertools.product(
        [(f32, f32), (f16, f32), (f32, f16), (f32, bf16), (bf16, bf16)],
        [1, 4, 12, 64],
        [(256, 512), (6, 256), (4096, 4096)],
        [4, 8],
        [32, 64],
    ):
        print(f"x {xd} scales {sd} M {m} N {n} K {k} bits {bits} group {group}: {_case(m, n, k, bits, group, xd, sd)}")
    for m in (1, 12):  # (not [4, 128, 64] at group 64: input one group wide hangs MLX 0.32.4's CUDA kernel)
        print(f"batched [4, 128, 256] weights, x f32 M {m}: {_case(m, 128, 256, 4, 64, f32, f32, batch=4)}")


if __name__ == "__main__":
    main()
