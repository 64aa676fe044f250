"""Paged decode attention alone on CUDA: mlxcel's kernel (mlxcel_core/kv/cuda_paged_attention.py) at each num_splits
against MLX's fused scaled_dot_product_attention on a dense cache (what mlx-lm decodes with), batch-1 shapes.

    python benchmarks/paged_decode.py                                   # Llama-3-8B geometry, contexts 16..4096
    python benchmarks/paged_decode.py --head-dim 64 --q-heads 32 --kv-heads 8 --context 512

Per context: the median time of one call (calls built lazily, one eval, as benchmarks/qmv.py times GEMVs), the
largest difference from the dense SDPA output, and the split count the engine's heuristic picks there. Blocks of
the context sit at shuffled pool rows, as in a running server.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import mlx.core as mx  # noqa: E402

from autotune.ops import Bucket, Geometry, default_splits  # noqa: E402
from mlxcel_core.kv import cuda_paged_attention as cpa  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_qmv", HERE / "qmv.py")  # its timing helper
bench_qmv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_qmv)


def make_case(ctx: int, hq: int, hkv: int, d: int, bs: int, dtype, seed: int = 0):
    n_blocks = -(-ctx // bs)
    rows = list(range(2 * n_blocks + 1))
    random.Random(seed).shuffle(rows)
    table = mx.array([rows[:n_blocks]], dtype=mx.int32)
    k_pool = mx.random.normal((len(rows), bs, hkv, d), key=mx.random.key(seed)).astype(dtype)
    v_pool = mx.random.normal((len(rows), bs, hkv, d), key=mx.random.key(seed + 1)).astype(dtype)
    q = mx.random.normal((1, hq, d), key=mx.random.key(seed + 2)).astype(dtype)
    lens = mx.array([ctx], dtype=mx.int32)
    dense_k = k_pool[table].reshape(1, n_blocks * bs, hkv, d)[:, :ctx].transpose(0, 2, 1, 3)
    dense_v = v_pool[table].reshape(1, n_blocks * bs, hkv, d)[:, :ctx].transpose(0, 2, 1, 3)
    dense_k, dense_v = mx.contiguous(dense_k), mx.contiguous(dense_v)
    mx.eval(k_pool, v_pool, q, table, lens, dense_k, dense_v)
    return q, (k_pool, v_pool, table, lens), (dense_k, dense_v)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--context", type=int, nargs="+", default=[16, 512, 4096])
    parser.add_argument("--splits", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--calls", type=int, default=64)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    if not cpa.cuda_kernel_available():
        print("paged_decode.py needs MLX's CUDA backend and a CUDA device", file=sys.stderr)
        return 1
    dtype = getattr(mx, args.dtype)
    d, hq, hkv, bs = args.head_dim, args.q_heads, args.kv_heads, args.block_size
    scale = d ** -0.5
    print(f"head_dim {d}, q heads {hq}, kv heads {hkv}, block size {bs}, {args.dtype}; geometry "
          f"{cpa.launch_geometry(d, hq // hkv)}; {args.calls} calls per eval, median of {args.reps}")
    for ctx in args.context:
        q, paged, dense = make_case(ctx, hq, hkv, d, bs, dtype)
        q4 = q[:, :, None, :]

        def sdpa(q4_, k, v):
            return mx.fast.scaled_dot_product_attention(q4_, k, v, scale=scale)

        t_sdpa, _ = bench_qmv.time_calls(sdpa, q4, [dense], args.calls, args.reps)
        ref = sdpa(q4, *dense)[:, :, 0, :].astype(mx.float32)
        default = default_splits(Bucket.of(1, paged[2].shape[1] * bs, Geometry(d, hq, hkv, bs)), cpa.RUNNER_CUDA)
        cells = []
        for s in sorted(set(args.splits) | {default}):
            def ours(q_, k_pool, v_pool, table, lens, s=s):
                return cpa.cuda_paged_decode_attention(q_, k_pool, v_pool, table, lens, num_splits=s, scale=scale)

            t, _ = bench_qmv.time_calls(ours, q, [paged], args.calls, args.reps)
            diff = float(mx.abs(ours(q, *paged).astype(mx.float32) - ref).max())
            cells.append(f"S={s}{'*' if s == default else ''} {t * 1e6:.1f} us (diff {diff:.1e})")
        print(f"context {ctx:>6}: MLX SDPA dense {t_sdpa * 1e6:.1f} us | " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
