"""On an H200: python -m pytest -q tests/mlxcel_core/backends/cuda/kernels && python benchmarks/qmv.py

MLX's quantized_matmul vs mlxcel's 4-bit decode matvec kernel (backends/cuda/kernels/qmv.py), on CUDA only.

    python benchmarks/qmv.py                        # Llama-3-8B decode GEMVs, M = 1, 2, 4, 8, bf16; then end to end
    python benchmarks/qmv.py --m 1 8 --dtype float16 --no-e2e
    python benchmarks/qmv.py --no-sweep             # only the default launch configuration

For each of Llama-3-8B's decode GEMVs (q/o 4096x4096, k/v 1024x4096, gate/up 14336x4096, down 4096x14336, the LM
head 128256x4096; 4-bit, group size 64) and each M (rows of x): the median time of one call, GB/s = bytes of the
packed weights + scales + biases / time, and the speedup. Timing: `--calls` independent calls are built as one
lazy graph (not timed), then one mx.eval runs them one after another on one stream (MLX_USE_CUDA_GRAPHS=0 unless
--concurrent: inside a CUDA graph independent calls overlap, which hides a launch too small to fill the GPU); the
time per call is that eval's wall time / calls, median over `--reps` repetitions after a warm-up (compilation
included there). Calls cycle over enough copies of the weights (>= 3 x the 50 MB L2) that every call reads its
weights from HBM. "host us" is the Python + MLX graph-building time per call (not in the GPU time; the engine
overlaps it with the GPU via mx.async_eval). "max rel diff" compares the two results (MLX's own CUDA matvec
accumulates in bf16, so ~1e-2 is expected; the kernel's accuracy is what tests/mlxcel_core/backends/cuda/kernels
checks against a float64 reference).

--sweep (default on) also times the (ROWS, WARPS) launch configurations of SWEEP and prints the best one next to
the default that `launch_config` picks: if the best is much faster, update `launch_config`. The M at which the
kernel stops beating MLX bounds qmv.MAX_ROWS (the rows of x a decode layer gives the kernel, fast_linear.py).

End to end (--e2e, default on; with --concurrent only, as decoding runs with CUDA graphs): a random 4-bit Llama-3-8B
(mlxcel_core.loading.shapes), greedy decode of --e2e-tokens tokens at batch 1 (graph of step t+1 built while step t
runs, mx.async_eval), plain MLX layers vs the swapped layers (use_fast_quantized_linear: MIN_WEIGHT and
LAYER_MAX_ROWS as they are), tok/s, the weight bytes per second that implies, and the host time spent building each
step's graph (when it is close to the time per token, decode is bound by Python/MLX graph building, not by the GPU).
Through the CLI, the whole CUDA wing off (MLX's ops throughout) and on, not this kernel alone:
    MLXCEL_CUDA=0 mlxcel bench --model-shape llama-3-8b --bits 4 -p 0 -n 128
    mlxcel bench --model-shape llama-3-8b --bits 4 -p 0 -n 128
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Calls that share no array run concurrently inside MLX's CUDA graphs, so a launch that leaves most of the GPU idle
# looks fast here and is slow in a model, where each projection waits for the one before (H200, tenth session:
# occupancy 24-42% in the model). Without CUDA graphs MLX launches onto one stream, one kernel after another, as a
# model's chain runs them; --concurrent keeps the graphs (the older, misleading timing). Read before MLX starts.
if "--concurrent" not in sys.argv:
    os.environ.setdefault("MLX_USE_CUDA_GRAPHS", "0")

import mlxcel_core  # noqa: F401,E402  (before mlx: MLX's CPU products on OpenBLAS, cpu_blas.py)

# isort: split
import mlx.core as mx  # noqa: E402

from mlxcel_core.backends.cuda.kernels import qmv  # noqa: E402

GROUP_SIZE = 64
L2_BYTES = 50 * 2**20
SHAPES = [  # (name, N, K): Llama-3-8B
    ("q_proj/o_proj", 4096, 4096),
    ("k_proj/v_proj", 1024, 4096),
    ("gate/up_proj", 14336, 4096),
    ("down_proj", 4096, 14336),
    ("lm_head", 128256, 4096),
]
# UNROLL 2 and ROWS 1 never won the first H200 sweep; every ROWS x WARPS config compiles once per M (NVRTC).
SWEEP = [(rows, warps, unroll) for rows in (2, 4, 8) for warps in (1, 2, 4, 8) for unroll in (1, 2)]


def weight_bytes(w: mx.array, scales: mx.array, biases: mx.array) -> int:
    return w.nbytes + scales.nbytes + biases.nbytes


def make_weights(n: int, k: int, dtype, copies: int, seed: int = 0, group_size: int = GROUP_SIZE):
    out = []
    key = mx.random.key(seed)
    for _ in range(copies):
        key, sub = mx.random.split(key)
        w = (mx.random.normal((n, k), key=sub) * 0.02).astype(dtype)
        q = mx.quantize(w, group_size=group_size, bits=4)
        mx.eval(q)
        out.append(q)
        del w
    return out


def time_calls(fn, x, weights, calls: int, reps: int) -> tuple[float, float]:
    """(median GPU seconds per call, host seconds per call to build the graph)."""

    def build():
        t0 = time.perf_counter()
        outs = [fn(x, *weights[i % len(weights)]) for i in range(calls)]
        return outs, time.perf_counter() - t0

    outs, _ = build()
    mx.eval(outs)  # warm-up (compiles the kernel variant)
    times, hosts = [], []
    for _ in range(reps):
        outs, host = build()
        t0 = time.perf_counter()
        mx.eval(outs)
        times.append(time.perf_counter() - t0)
        hosts.append(host)
        del outs
    return statistics.median(times) / calls, statistics.median(hosts) / calls


def mlx_qmm(x, w, scales, biases):
    group_size = x.shape[-1] // scales.shape[-1]
    return mx.quantized_matmul(x, w, scales=scales, biases=biases, transpose=True, group_size=group_size, bits=4)


def ours(config=None):
    def fn(x, w, scales, biases):
        return qmv.cuda_quantized_matvec(x, w, scales, biases, GROUP_SIZE, config=config)

    return fn


def max_rel_diff(a: mx.array, b: mx.array) -> float:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.abs(a - b).max() / mx.maximum(mx.abs(b).max(), 1e-30)).item()


def bench_gemvs(args) -> None:
    dtype = getattr(mx, args.dtype)
    print(
        f"kernel {qmv.KERNEL_NAME}; {args.dtype}; group size {GROUP_SIZE}; {args.calls} calls per eval, "
        f"median of {args.reps}"
    )
    header = (
        f"{'shape':<14} {'N':>6} {'K':>6} {'M':>2} | {'MLX us':>8} {'GB/s':>6} | {'ours us':>8} {'GB/s':>6} "
        f"{'speedup':>7} | {'host us MLX/ours':>16} | {'max rel diff':>12} | config"
    )
    print(header)
    print("-" * len(header))
    for name, n, k in SHAPES:
        if args.shapes and name not in args.shapes:
            continue
        one = make_weights(n, k, dtype, 1)
        nbytes = weight_bytes(*one[0])
        copies = max(2, min(64, math.ceil(3 * L2_BYTES / nbytes)))
        weights = one + make_weights(n, k, dtype, copies - 1, seed=1)
        for m in args.m:
            x = mx.random.normal((m, k), key=mx.random.key(m)).astype(dtype)
            mx.eval(x)
            assert qmv.supports(x, *weights[0]), "the kernel does not take this shape"
            t_mlx, h_mlx = time_calls(mlx_qmm, x, weights, args.calls, args.reps)
            default = qmv.launch_config(n, k, m)
            t_ours, h_ours = time_calls(ours(), x, weights, args.calls, args.reps)
            diff = max_rel_diff(ours()(x, *weights[0]), mlx_qmm(x, *weights[0]))
            best = ""
            if args.sweep:
                results = []
                for config in SWEEP:
                    t, _ = time_calls(ours(config), x, weights, args.calls, max(3, args.reps // 3))
                    results.append((t, config))
                t_best, c_best = min(results)
                best = f"; best {c_best} {nbytes / t_best / 1e9:.0f} GB/s ({t_ours / t_best:.2f}x the default)"
            print(
                f"{name:<14} {n:>6} {k:>6} {m:>2} | {t_mlx * 1e6:>8.1f} {nbytes / t_mlx / 1e9:>6.0f} | "
                f"{t_ours * 1e6:>8.1f} {nbytes / t_ours / 1e9:>6.0f} {t_mlx / t_ours:>6.2f}x | "
                f"{h_mlx * 1e6:>7.1f}/{h_ours * 1e6:<8.1f} | {diff:>12.2e} | default {default}{best}",
                flush=True,
            )
        del weights, one


def bench_e2e(args) -> None:
    from mlxcel_core.backends.cuda.kernels.fast_linear import restore_quantized_linear, use_fast_quantized_linear
    from mlxcel_core.backends.cuda.kernels.fused_projections import unfuse_projections
    from mlxcel_core.cache import make_cache
    from mlxcel_core.loading.shapes import build_random_model, count_parameters

    print(f"\nend to end: random llama-3-8b, 4-bit, {args.dtype}, greedy decode at batch 1, {args.e2e_tokens} tokens")
    model, _ = build_random_model("llama-3-8b", bits=4, dtype=args.dtype)
    unfuse_projections(model)  # fused projections (a GPU default) would run the kernel in the "MLX" rounds too
    _, nbytes = count_parameters(model)
    prompt = mx.array([list(range(100, 116))])

    def decode() -> tuple[float, list[int], float]:
        cache = make_cache(len(model.layers))
        token = mx.argmax(model(prompt, cache)[:, -1], axis=-1)
        mx.eval(token)
        tokens = []
        host = 0.0
        t0 = time.perf_counter()
        for _ in range(args.e2e_tokens):
            tokens.append(token)
            t1 = time.perf_counter()
            token = mx.argmax(model(token[:, None], cache)[:, -1], axis=-1)
            host += time.perf_counter() - t1
            mx.async_eval(token)
        mx.eval(token)
        elapsed = time.perf_counter() - t0
        return args.e2e_tokens / elapsed, [t.item() for t in tokens], host / args.e2e_tokens

    rates = {}
    for label in ("MLX", "ours", "MLX", "ours"):  # interleaved; the first of each is a warm-up
        if label == "ours":
            use_fast_quantized_linear(model)
        else:
            restore_quantized_linear(model)
        rates.setdefault(label, []).append(decode())
    for label in ("MLX", "ours"):
        tps, tokens, host = rates[label][-1]
        print(
            f"{label:>5}: {tps:7.1f} tok/s = {1e3 / tps:5.2f} ms/token ({tps * nbytes / 1e9:5.0f} GB/s of weights); "
            f"graph building {host * 1e3:5.2f} ms/token; first tokens {tokens[:8]}"
        )
    same = rates["MLX"][-1][1] == rates["ours"][-1][1]
    print(
        f"speedup {rates['ours'][-1][0] / rates['MLX'][-1][0]:.2f}x; greedy tokens "
        f"{'identical' if same else 'differ (random weights in bf16: near-ties, see tests)'}"
    )


def gemv_parser(description: str) -> argparse.ArgumentParser:
    """The arguments of this script's GEMV table (benchmarks/hmv.py's too)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8], help="rows of x (1..8)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--shapes", nargs="*", help="only these shape names")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--concurrent",
        action="store_true",
        help="keep MLX's CUDA graphs: independent calls overlap (read before MLX starts)",
    )
    return parser


def main() -> int:
    parser = gemv_parser(__doc__.splitlines()[2])
    parser.add_argument("--e2e", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--e2e-tokens", type=int, default=128)
    args = parser.parse_args()
    if not qmv.cuda_kernel_available():
        print(
            "benchmarks/qmv.py: needs MLX's CUDA backend and a CUDA device (mx.cuda.is_available() is False "
            "here); the kernel only exists there, elsewhere quantized_matvec is mx.quantized_matmul.",
            file=sys.stderr,
        )
        return 1
    if any(not 1 <= m <= qmv.MAX_ROWS for m in args.m):
        parser.error(f"--m values must be 1..{qmv.MAX_ROWS}")
    bench_gemvs(args)
    if args.e2e and os.environ.get("MLX_USE_CUDA_GRAPHS") == "0":
        print(
            "\nend to end: skipped, CUDA graphs are off for the GEMV table (a decode runs with them: rerun with "
            "--concurrent, or use compare_mlx_lm.py)"
        )
    elif args.e2e:
        bench_e2e(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
