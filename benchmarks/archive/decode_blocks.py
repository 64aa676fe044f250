"""One decode step's blocks, MLX's ops against mlxcel's 16-bit kernel (MLXCEL_HMV), on a random model shape.

    python benchmarks/decode_blocks.py --model-shape llama-3-8b          # bf16, M = 1
    python benchmarks/decode_blocks.py --model-shape llama-3.2-1b --m 1 2

Per block of a decoder layer, the median GPU time of one call (calls built lazily and evaluated together, one
stream unless --concurrent, layers cycled so weights come from HBM, as benchmarks/qmv.py times GEMVs): the fused q/k/v projection split into q, k, v;
o_proj with the residual add; gate/up with SwiGLU; down_proj with the residual add; and the LM head. The same
model is timed with its layers on MLX's matmuls and then swapped onto the kernel (and re-fused), so a block that
makes the whole model slower with the kernel (the H200 measured llama-3-8b bf16 at 0.68x mlx-lm with it, 1.22x
without) shows which launch it is. Runs on CPU too (the kernel then falls back to MLX: both columns time MLX).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

if "--concurrent" not in sys.argv:  # one stream, calls in sequence as in a model (benchmarks/qmv.py says why)
    os.environ.setdefault("MLX_USE_CUDA_GRAPHS", "0")

import mlx.core as mx  # noqa: E402

from mlxcel_core.backends.cuda.kernels import fast_linear, fused_projections, qmv  # noqa: E402
from mlxcel_core.models.activations import swiglu  # noqa: E402
from mlxcel_core.models.shapes import build_random_model, shape_names  # noqa: E402
from mlxcel_core.models.transformer import add_projection  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_qmv", HERE / "qmv.py")  # its timing helper
bench_qmv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_qmv)

BLOCKS = {  # name -> (layer, x, residual) -> output
    "q/k/v": lambda layer, x, r: layer.self_attn.fused_qkv.split(x),
    "o_proj+res": lambda layer, x, r: add_projection(layer.self_attn.o_proj, x, r),
    "gate/up+swiglu": lambda layer, x, r: layer.mlp.fused_gate_up.gated(x, swiglu),
    "down+res": lambda layer, h, r: add_projection(layer.mlp.down_proj, h, r),
}


def time_blocks(model, m: int, layers: int, calls: int, reps: int) -> dict[str, float]:
    hidden = model.layers[0].self_attn.o_proj["weight"].shape[0]
    inter = model.layers[0].mlp.down_proj["weight"].shape[1]
    dtype = model.layers[0].mlp.down_proj["weight"].dtype
    x = mx.random.normal((m, hidden), key=mx.random.key(1)).astype(dtype)
    h = mx.random.normal((m, inter), key=mx.random.key(2)).astype(dtype)
    r = mx.random.normal((m, hidden), key=mx.random.key(3)).astype(dtype)
    mx.eval(x, h, r)
    stack = [(layer,) for layer in model.layers[:layers]]
    out = {}
    for name, block in BLOCKS.items():
        inp = h if name == "down+res" else x
        out[name] = bench_qmv.time_calls(lambda inp_, layer: block(layer, inp_, r), inp, stack, calls, reps)[0]
    head = model.lm_head if hasattr(model, "lm_head") else model.model.embed_tokens.as_linear
    out["lm_head"] = bench_qmv.time_calls(lambda inp_, _: head(inp_), x, [(None,)], max(4, calls // 8), reps)[0]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-shape", default="llama-3-8b", choices=shape_names())
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--m", type=int, nargs="+", default=[1], help="rows of x (decode batch)")
    parser.add_argument("--layers", type=int, default=4, help="layers cycled through (each call reads new weights)")
    parser.add_argument("--calls", type=int, default=64)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--concurrent", action="store_true",
                        help="keep MLX's CUDA graphs: independent calls overlap (read before MLX starts)")
    args = parser.parse_args()
    os.environ["MLXCEL_HMV"] = "0"  # built on MLX's matmuls first
    os.environ["MLXCEL_FUSE"] = "1"
    model, _ = build_random_model(args.model_shape, dtype=args.dtype, seed=0)
    print(f"{args.model_shape} {args.dtype}; kernel on CUDA: {qmv.kernel_ready()}; {args.calls} calls per eval, "
          f"median of {args.reps}, {args.layers} layers cycled")
    mlx_times = {m: time_blocks(model, m, args.layers, args.calls, args.reps) for m in args.m}
    fused_projections.unfuse_projections(model)
    fast_linear.use_fast_half_linear(model)
    fused_projections.fuse_projections(model)
    ours = {m: time_blocks(model, m, args.layers, args.calls, args.reps) for m in args.m}
    print(f"{'block':<15} {'M':>2} | {'MLX us':>8} | {'kernel us':>9} | {'speedup':>7}")
    for m in args.m:
        for name in mlx_times[m]:
            a, b = mlx_times[m][name], ours[m][name]
            print(f"{name:<15} {m:>2} | {a * 1e6:>8.1f} | {b * 1e6:>9.1f} | {a / b:>6.2f}x")
        total_a = sum(v for k, v in mlx_times[m].items() if k != "lm_head")
        total_b = sum(v for k, v in ours[m].items() if k != "lm_head")
        print(f"{'layer (sum)':<15} {m:>2} | {total_a * 1e6:>8.1f} | {total_b * 1e6:>9.1f} | "
              f"{total_a / total_b:>6.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
