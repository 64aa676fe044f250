"""A prompt's 4-bit products two ways: MLX's quantized_matmul against the weight dequantized to x's dtype and
multiplied by MLX's (cuBLAS) matmul, on Llama-3-8B's projections, at prompt row counts.

    python benchmarks/prefill_products.py                      # 128, 512, 2048 rows, bfloat16
    python benchmarks/prefill_products.py --rows 512 --dtype float16

What it answers: whether a prefill's 4-bit layers gain by dequantizing each weight (read 4-bit, write 16-bit) before
a 16-bit GEMM, as llama.cpp's cuBLAS path does for large batches; and up to kernels/qmm.py's MAX_ROWS rows (a decode
batch) how mlxcel's batch kernel compares with both. TFLOP/s counts 2*M*N*K a call.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("MLX_USE_CUDA_GRAPHS", "0")

import mlx.core as mx  # noqa: E402
from qmv import GROUP_SIZE, L2_BYTES, make_weights, max_rel_diff, mlx_qmm, time_calls, weight_bytes  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mlxcel_core.backends.cuda.kernels import qmm  # noqa: E402
from mlxcel_core.backends.cuda.kernels.qmv import kernel_ready  # noqa: E402

SHAPES = [  # (name, N, K): Llama-3-8B's projections as a prefill runs them (fused q/k/v and gate/up)
    ("q/k/v fused", 6144, 4096),
    ("o_proj", 4096, 4096),
    ("gate/up fused", 28672, 4096),
    ("down_proj", 4096, 14336),
]


def dequant_matmul(x, w, scales, biases):
    full = mx.dequantize(w, scales, biases, group_size=GROUP_SIZE, bits=4, dtype=x.dtype)
    return mx.matmul(x, full.T)


def batch_kernel(x, w, scales, biases):
    return qmm.quantized_matmul(x, w, scales, biases, GROUP_SIZE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="128,512,2048")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    dtype = getattr(mx, args.dtype)
    print(f"{args.dtype}; group size {GROUP_SIZE}; {args.calls} calls per eval, median of {args.reps}")
    head = (
        f"{'shape':<14} {'M':>5} | {'MLX qmm us':>10} {'TF/s':>6} | {'deq+mm us':>10} {'TF/s':>6} | ratio | rel diff"
        f" | {'qmm.py us':>9} {'TF/s':>6}"
    )
    print(head)
    print("-" * len(head))
    for name, n, k in SHAPES:
        one = make_weights(n, k, dtype, 1)
        copies = max(2, min(16, math.ceil(3 * L2_BYTES / weight_bytes(*one[0]))))
        weights = one + make_weights(n, k, dtype, copies - 1, seed=1)
        for m in [int(r) for r in args.rows.split(",")]:
            x = (mx.random.normal((m, k)) * 0.5).astype(dtype)
            t_q, _ = time_calls(mlx_qmm, x, weights, args.calls, args.reps)
            t_d, _ = time_calls(dequant_matmul, x, weights, args.calls, args.reps)
            flops = 2.0 * m * n * k
            diff = max_rel_diff(dequant_matmul(x, *weights[0]), mlx_qmm(x, *weights[0]))
            ours = ""
            if kernel_ready() and qmm.launch_args(x.shape, x.dtype, dtype, n, k, GROUP_SIZE) is not None:
                t_o, _ = time_calls(batch_kernel, x, weights, args.calls, args.reps)
                ours = f" | {t_o * 1e6:>9.1f} {flops / t_o / 1e12:>6.1f}"
            print(
                f"{name:<14} {m:>5} | {t_q * 1e6:>10.1f} {flops / t_q / 1e12:>6.1f} | {t_d * 1e6:>10.1f} "
                f"{flops / t_d / 1e12:>6.1f} | {t_q / t_d:>5.2f}x | {diff:.2e}{ours}",
                flush=True,
            )
        del weights, one


if __name__ == "__main__":
    main()
