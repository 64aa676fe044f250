"""Why mlxcel trails llama.cpp on the CPU: one SmolLM2 projection (1536 x 576) through MLX's CPU kernels (4-bit
quantized_matmul, float32 matmul, dequantize then matmul) and through numpy's BLAS (float32), at 1 and 64 rows.

    python benchmarks/archive/2026-12-02-llama-cpp-peer/cpu_gemm.py
"""

import time

import mlx.core as mx
import numpy as np

mx.set_default_device(mx.cpu)
K, N, REPS = 576, 1536, 20
w = mx.random.normal((N, K), key=mx.random.key(0)) * 0.02
wq, s, b = mx.quantize(w, group_size=32, bits=4)
wn = np.array(w)


def timed(fn, sync=lambda out: None) -> float:
    sync(fn())
    start = time.perf_counter()
    for _ in range(REPS):
        sync(fn())
    return (time.perf_counter() - start) / REPS


for m in (1, 64):
    x = mx.random.normal((m, K), key=mx.random.key(1))
    xn = np.array(x)
    cases = {
        "MLX 4-bit quantized_matmul": (lambda: mx.quantized_matmul(x, wq, s, b, True, 32, 4), mx.eval),
        "MLX float32 matmul": (lambda: x @ w.T, mx.eval),
        "MLX dequantize + matmul": (lambda: x @ mx.dequantize(wq, s, b, 32, 4).T, mx.eval),
        "numpy float32 matmul": (lambda: xn @ wn.T, lambda out: None),
    }
    for name, (fn, sync) in cases.items():
        dt = timed(fn, sync)
        print(f"rows {m:>2}  {name:<28} {dt * 1e3:8.3f} ms  {m * N * K * 2 / dt / 1e9:6.2f} GFLOP/s")
