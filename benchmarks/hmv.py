"""On an H200: python -m pytest -q tests/mlxcel_core/backends/cuda/kernels/test_hmv.py && python benchmarks/hmv.py

MLX's bf16 matmul (x @ W.T) vs mlxcel's 16-bit decode matvec kernel (backends/cuda/kernels/hmv.py), CUDA only.

    python benchmarks/hmv.py                        # Llama-3-8B and Llama-3.2-1B decode GEMVs, M = 1, 2, 4, 8, bf16
    python benchmarks/hmv.py --m 1 --shapes 8b:down_proj --no-sweep

For each decode GEMV and M (rows of x): the median time of one call, GB/s of weight bytes read (and the share of the
H200's 4.3 TB/s copy bandwidth), the speedup, and with --sweep (default) the fastest (ROWS, WARPS, UNROLL) of SWEEP
next to the default `hmv.launch_config` picks: if it is much faster, update `launch_config`. Timing as
benchmarks/qmv.py (its `time_calls`: calls built lazily, one eval, weights cycled past the L2, one stream
unless --concurrent).

End to end, beside mlx-lm, with the CUDA wing (this kernel among its others) and without it (MLX's ops throughout):
    python benchmarks/compare_mlx_lm.py --model-shape llama-3.2-1b --dtype bfloat16 --rounds 3
    MLXCEL_CUDA=0 python benchmarks/compare_mlx_lm.py --model-shape llama-3.2-1b --dtype bfloat16 --rounds 3
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

if "--concurrent" not in sys.argv:  # one stream, calls in sequence as in a model (benchmarks/qmv.py says why)
    os.environ.setdefault("MLX_USE_CUDA_GRAPHS", "0")

import mlxcel_core  # noqa: F401,E402  (before mlx: MLX's CPU products on OpenBLAS, cpu_blas.py)

# isort: split
import mlx.core as mx  # noqa: E402

from mlxcel_core.backends.cuda.kernels import hmv, qmv  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_qmv", HERE / "qmv.py")  # its timing helpers and arguments
bench_qmv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_qmv)

ROOFLINE_GBS = 4300  # the H200's measured copy bandwidth (../shared/gpu/README.md)
SHAPES = [  # (name, N, K)
    ("8b:q/o_proj", 4096, 4096),
    ("8b:k/v_proj", 1024, 4096),
    ("8b:gate/up", 14336, 4096),
    ("8b:gate+up", 28672, 4096),
    ("1b:gate+up", 16384, 2048),  # fused as the model runs them (swiglu mode)
    ("8b:down_proj", 4096, 14336),
    ("8b:lm_head", 128256, 4096),
    ("1b:q/o_proj", 2048, 2048),
    ("1b:k/v_proj", 512, 2048),
    ("1b:gate/up", 8192, 2048),
    ("1b:down_proj", 2048, 8192),
    ("1b:lm_head", 128256, 2048),
]
SWEEP = [(rows, warps, unroll) for rows in (2, 4, 8) for warps in (1, 2, 4, 8) for unroll in (1, 2, 4)]


def make_weights(n: int, k: int, dtype, copies: int) -> list[tuple[mx.array]]:
    out = []
    for i in range(copies):
        w = (mx.random.normal((n, k), key=mx.random.key(i)) * 0.02).astype(dtype)
        mx.eval(w)
        out.append((w,))
    return out


def mlx_matvec(x, w):
    return x @ w.T


def ours(config=None):
    def fn(x, w):
        return hmv.launch(hmv.launch_args(x.shape, x.dtype, w.dtype, w.shape[0], config), x, w)

    return fn


def main() -> int:
    args = bench_qmv.gemv_parser(__doc__.splitlines()[2]).parse_args()
    if not qmv.kernel_ready():
        print("hmv.py needs MLX's CUDA backend and a CUDA device", file=sys.stderr)
        return 1
    dtype = getattr(mx, args.dtype)
    print(
        f"kernel {qmv.kernel_name('plain', 'half')}; {args.dtype}; {args.calls} calls per eval, median of {args.reps}"
    )
    header = (
        f"{'shape':<13} {'N':>6} {'K':>6} {'M':>2} | {'MLX us':>7} {'GB/s':>5} {'%':>3} | {'ours us':>7} "
        f"{'GB/s':>5} {'%':>3} {'speedup':>7} | {'max rel diff':>12} | config"
    )
    print(header)
    print("-" * len(header))
    for name, n, k in SHAPES:
        if args.shapes and name not in args.shapes:
            continue
        nbytes = n * k * 2
        weights = make_weights(n, k, dtype, max(2, min(64, math.ceil(3 * bench_qmv.L2_BYTES / nbytes))))
        for m in args.m:
            x = mx.random.normal((m, k), key=mx.random.key(m)).astype(dtype)
            mx.eval(x)
            t_mlx, _ = bench_qmv.time_calls(mlx_matvec, x, weights, args.calls, args.reps)
            t_ours, _ = bench_qmv.time_calls(ours(), x, weights, args.calls, args.reps)
            diff = bench_qmv.max_rel_diff(ours()(x, *weights[0]), mlx_matvec(x, *weights[0]))
            best = ""
            if args.sweep:
                results = [
                    (bench_qmv.time_calls(ours(c), x, weights, args.calls, max(3, args.reps // 3))[0], c) for c in SWEEP
                ]
                ranked = sorted(results)
                t_best, c_best = ranked[0]
                best = f"; best {c_best} {nbytes / t_best / 1e9:.0f} GB/s ({t_ours / t_best:.2f}x the default)"
                best += "; then " + ", ".join(f"{c} {nbytes / t / 1e9:.0f}" for t, c in ranked[1:4])
            gbs_mlx, gbs_ours = nbytes / t_mlx / 1e9, nbytes / t_ours / 1e9
            print(
                f"{name:<13} {n:>6} {k:>6} {m:>2} | {t_mlx * 1e6:>7.1f} {gbs_mlx:>5.0f} "
                f"{100 * gbs_mlx / ROOFLINE_GBS:>3.0f} | {t_ours * 1e6:>7.1f} {gbs_ours:>5.0f} "
                f"{100 * gbs_ours / ROOFLINE_GBS:>3.0f} {t_mlx / t_ours:>6.2f}x | {diff:>12.2e} | "
                f"default {hmv.launch_config(n, k, m)}{best}",
                flush=True,
            )
        del weights
    return 0


if __name__ == "__main__":
    sys.exit(main())
