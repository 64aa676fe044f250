"""Decode-batch 4-bit matmuls on the H200: where does an 8B 4-bit batch step go? (CUDA only)

    python benchmarks/qmm_batch.py                   # Llama-3-8B's projections, M = 1, 2, 4, 8, 16, 32 rows of x
    python benchmarks/qmm_batch.py --m 8 32 --shapes gate/up_proj

Why: batch_decode.py on the 8B 4-bit shape gave 259 tok/s at b=1 but only 266 at b=8 and 301 at b=32 (fifteenth
session), mlx-lm the same, while the 1B bf16 shape scaled to 7635 at b=32. Per shape and M, the median time of one
call (each call reads its weights from HBM; qmv.py's timing, one stream, no CUDA graphs) of:
  MLX      mx.quantized_matmul, x as (M, K) (MLXCEL_QMM_BATCH=matrix)
  MLX (M,1,K) the same with x shaped as a decode batch holds it, one row per sequence (MLXCEL_QMM_BATCH=mlx)
  deq+mm   mx.dequantize to bf16, then x @ W.T (cuBLAS): reads the 4-bit weight, writes and reads a bf16 copy
  ours     kernels/qmv.py's matvec kernel, 8 rows a launch (more rows: MLXCEL_QMM_BATCH=chunks)
  mma      kernels/qmm.py, the tensor cores, up to 32 rows a launch (MLXCEL_QMM_BATCH=mma, the default); its
           largest difference from MLX's result is printed once per shape and M
  mma wide the same with MLXCEL_QMM_WIDE=1's load layout (vector loads of weights and x)
GB/s counts the packed weight + scales + biases once, as a matvec reads them.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("MLX_USE_CUDA_GRAPHS", "0")  # calls run one after another, as in a model (see qmv.py)

import mlx.core as mx  # noqa: E402

from qmv import (GROUP_SIZE, L2_BYTES, SHAPES, make_weights, max_rel_diff, mlx_qmm, time_calls,  # noqa: E402
                 weight_bytes)
from mlxcel_core.backends.cuda.kernels import qmm, qmv  # noqa: E402


def dequant_mm(x, w, scales, biases):
    full = mx.dequantize(w, scales=scales, biases=biases, group_size=GROUP_SIZE, bits=4)
    return x @ full.astype(x.dtype).T


def mlx_qmm_rows(x, w, scales, biases):
    # x as a decode batch holds it: one row per sequence, (M, 1, K)
    return mlx_qmm(x[:, None, :], w, scales, biases)


def ours(x, w, scales, biases):
    # more rows than one launch takes: MAX_ROWS a launch (MLXCEL_QMM_BATCH=chunks)
    step = qmv.MAX_ROWS
    parts = [qmv.cuda_quantized_matvec(x[i:i + step], w, scales, biases, GROUP_SIZE) for i in range(0, len(x), step)]
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)


def mma(x, w, scales, biases):
    return qmm.quantized_matmul(x, w, scales, biases, GROUP_SIZE, wide=False)


def mma_wide(x, w, scales, biases):
    return qmm.quantized_matmul(x, w, scales, biases, GROUP_SIZE, wide=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--shapes", nargs="*", default=["q_proj/o_proj", "k_proj/v_proj", "gate/up_proj",
                                                         "down_proj"])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    if not qmv.cuda_kernel_available():
        print("benchmarks/qmm_batch.py: needs MLX's CUDA backend", file=sys.stderr)
        return 1
    dtype = mx.bfloat16
    print(f"bf16 x, 4-bit weights (group {GROUP_SIZE}); us per call (GB/s of packed weight), median of {args.reps}")
    columns = " | ".join(f"{c:>15}" for c in ("MLX", "MLX (M,1,K)", "deq+mm", "ours", "mma", "mma wide"))
    print(f"{'shape':<14} {'N':>6} {'K':>6} {'M':>3} | {columns}")
    for name, n, k in SHAPES:
        if name not in args.shapes:
            continue
        weights = make_weights(n, k, dtype, 1)
        nbytes = weight_bytes(*weights[0])
        weights += make_weights(n, k, dtype, max(2, min(64, math.ceil(3 * L2_BYTES / nbytes))) - 1, seed=1)
        for m in args.m:
            x = mx.random.normal((m, k), key=mx.random.key(m)).astype(dtype)
            mx.eval(x)
            cells = []
            for fn in (mlx_qmm, mlx_qmm_rows, dequant_mm, ours, mma, mma_wide):
                t, _ = time_calls(fn, x, weights, args.calls, args.reps)
                cells.append(f"{t * 1e6:>8.1f} ({nbytes / t / 1e9:>4.0f})")
            diffs = [max_rel_diff(fn(x, *weights[0]), mlx_qmm(x, *weights[0])) for fn in (mma, mma_wide)]
            print(f"{name:<14} {n:>6} {k:>6} {m:>3} | " + " | ".join(cells)
                  + " | vs MLX: mma {:.1e}, wide {:.1e}".format(*diffs), flush=True)
        del weights
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
