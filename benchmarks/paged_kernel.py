"""The CUDA paged decode-attention kernel alone (backends/cuda/paged_attention.py), as the engine launches it: one
row, the step's own keys and values written in the kernel, the last block of each head group combining the splits.

    python benchmarks/paged_kernel.py                                  # Llama-3-8B geometry at 4k, 16k, 32k tokens
    python benchmarks/paged_kernel.py --context 32768 --splits 32 64 128 --bodies mma
    python benchmarks/paged_kernel.py --context 32768 --splits 32 64 --bodies mma --min-blocks 4

Per context, body (the tensor cores' where they take the inputs, the lane groups') and split count: the median time
of one call (calls in sequence on one stream, CUDA graphs off, as a model runs them), the bandwidth that gives
counting the K and V bytes the call reads (context x kv heads x head dim x 2 x the pool's item size), and the largest
difference from MLX's scaled_dot_product_attention on the same keys and values laid out densely. The context's blocks
sit at shuffled pool rows, as in a running server. `--min-blocks N` compiles the tensor-core body with
__launch_bounds__(128, N) (registers capped so that N blocks fit an SM; a cap below its 167 registers spills).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("MLX_USE_CUDA_GRAPHS", "0")  # (calls one after another: see benchmarks/hmv.py)
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import mlx.core as mx  # noqa: E402

from autotune.ops import Bucket, Geometry, default_splits  # noqa: E402
from mlxcel_core.backends.cuda import paged_attention as cpa  # noqa: E402


def make_case(ctx: int, hq: int, hkv: int, d: int, bs: int, dtype, seed: int = 0):
    """q [1, Hq, D], the pools, block table and context length of a `ctx`-token row whose last position is the step's
    own (k_new, v_new), and the same keys and values dense [1, Hkv, ctx, D] for the reference."""
    n_blocks = -(-ctx // bs)
    rows = list(range(n_blocks + 8))
    random.Random(seed).shuffle(rows)
    table = mx.array([rows[:n_blocks]], dtype=mx.int32)
    k_pool = mx.random.normal((len(rows), bs, hkv, d), key=mx.random.key(seed)).astype(dtype)
    v_pool = mx.random.normal((len(rows), bs, hkv, d), key=mx.random.key(seed + 1)).astype(dtype)
    q = mx.random.normal((1, hq, d), key=mx.random.key(seed + 2)).astype(dtype)
    k_new = mx.random.normal((1, hkv, d), key=mx.random.key(seed + 3)).astype(dtype)
    v_new = mx.random.normal((1, hkv, d), key=mx.random.key(seed + 4)).astype(dtype)
    last = ctx - 1
    slot = (mx.array([rows[last // bs]], dtype=mx.int32), mx.array([last % bs], dtype=mx.int32))
    lens = mx.array([ctx], dtype=mx.int32)
    dense_k = k_pool[table].reshape(1, n_blocks * bs, hkv, d)[:, :ctx]
    dense_v = v_pool[table].reshape(1, n_blocks * bs, hkv, d)[:, :ctx]
    dense_k = mx.concatenate([dense_k[:, :last], k_new[:, None]], axis=1).transpose(0, 2, 1, 3)
    dense_v = mx.concatenate([dense_v[:, :last], v_new[:, None]], axis=1).transpose(0, 2, 1, 3)
    dense_k, dense_v = mx.contiguous(dense_k), mx.contiguous(dense_v)
    mx.eval(k_pool, v_pool, q, table, lens, dense_k, dense_v, k_new, v_new, *slot)
    return q, (k_pool, v_pool, table, lens), (k_new, v_new, *slot), (dense_k, dense_v)


def bound_tensor_core_body(blocks: int) -> None:
    """Every tensor-core kernel the calls build from here on compiled with __launch_bounds__(THREADS, blocks), under
    its own name (the kernel cache keeps both)."""
    from mlxcel_core.backends.cuda.kernels import cubin_cache

    build = cubin_cache.cuda_kernel

    def bounded(**kwargs):
        if kwargs["name"].endswith("_mma"):
            kwargs = {**kwargs, "name": f"{kwargs['name']}_lb{blocks}", "launch_bounds": (cpa.THREADS, blocks)}
        return build(**kwargs)

    cubin_cache.cuda_kernel = bounded  # (paged_attention._kernel imports it at each build)
    cpa._kernel.cache_clear()


def time_calls(fn, calls: int, reps: int) -> float:
    """Median seconds per call over `reps` evaluations of `calls` calls each (one warm-up first)."""
    mx.eval([fn() for _ in range(calls)])
    times = []
    for _ in range(reps):
        outs = [fn() for _ in range(calls)]
        t0 = time.perf_counter()
        mx.eval(outs)
        times.append(time.perf_counter() - t0)
        del outs
    return statistics.median(times) / calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--context", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--splits", type=int, nargs="*", default=[], help="split counts beside the default rule's")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--bodies", nargs="+", default=["mma", "lanes"], choices=["mma", "lanes"])
    parser.add_argument("--min-blocks", type=int, help="the tensor-core body's __launch_bounds__ blocks an SM")
    parser.add_argument("--calls", type=int, default=32)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    if not cpa.cuda_kernel_available():
        print("paged_kernel.py needs MLX's CUDA backend and a CUDA device", file=sys.stderr)
        return 1
    dtype = getattr(mx, args.dtype)
    d, hq, hkv, bs = args.head_dim, args.q_heads, args.kv_heads, args.block_size
    print(
        f"head_dim {d}, q heads {hq}, kv heads {hkv}, block size {bs}, {args.dtype}; geometry: tensor cores "
        f"{cpa.launch_geometry(d, hq // hkv, True)}, lane groups {cpa.launch_geometry(d, hq // hkv)}; "
        f"{args.calls} calls an eval, median of {args.reps}; (default): the split rule's choice for this head dim"
    )
    if args.min_blocks:
        bound_tensor_core_body(args.min_blocks)
    counters = mx.zeros((cpa.COUNTERS,), mx.int32)
    for ctx in args.context:
        q, paged, new_kv, dense = make_case(ctx, hq, hkv, d, bs, dtype)
        ref = mx.fast.scaled_dot_product_attention(q[:, :, None, :], *dense, scale=d**-0.5)[:, :, 0, :]
        ref = ref.astype(mx.float32)
        default = default_splits(
            Bucket.of(1, paged[2].shape[1] * bs, Geometry(d, hq, hkv, bs)), cpa.RUNNER_CUDA, args.dtype
        )
        kv_bytes = ctx * hkv * d * 2 * mx.zeros((), dtype).itemsize
        for body, s in ((body, s) for s in sorted(set(args.splits) | {default}) for body in args.bodies):

            def call(s=s, mma=body == "mma"):
                return cpa.cuda_paged_decode_attention(
                    q, *paged, num_splits=s, new_kv=new_kv, counters=counters, mma=mma
                )

            diff = mx.abs(call().astype(mx.float32) - ref).max().item()
            sec = time_calls(call, args.calls, args.reps)
            mark = " (default)" if s == default else ""
            print(
                f"context {ctx:6d}  {body:6s}  splits {s:4d}{mark:10s}  {sec * 1e6:8.2f} us  "
                f"{kv_bytes / sec / 1e9:7.0f} GB/s  max abs diff vs SDPA {diff:.2e}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
