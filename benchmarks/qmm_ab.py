"""The decode-batch 4-bit kernels side by side on one GPU: kernels/qmm.py against kernels/qmm_staged.py (CUDA only).

    python benchmarks/qmm_ab.py                        # Llama-3-8B's projections, 16 and 32 rows of x
    python benchmarks/qmm_ab.py --m 9 32 --rounds 5

Per projection shape and row count: the median over --rounds of one call's time (--calls launches queued back to
back, then one wait, divided; the calls cycle through copies of the weight that together exceed the L2, so each
reads its weight from HBM, as a model's step does), for the plain kernel and the staged one alternately; GB/s
counts the packed weight, scales and biases once; and whether the two outputs are equal bit for bit (they should
be: same arithmetic). MLXCEL_QMM_STAGED decides which kernel a model runs (docs/settings.md); `batch_decode.py`
under each value measures the whole step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlxcel_core  # noqa: E402, F401  (first: on a CPU it installs the BLAS before MLX loads)

# isort: split
import mlx.core as mx  # noqa: E402

from mlxcel_core.backends.cuda.kernels import qmm  # noqa: E402

SHAPES = {  # Llama-3-8B: (N, K) of each 4-bit projection a decode step runs
    "q_proj": (4096, 4096),
    "k/v_proj": (1024, 4096),
    "o_proj": (4096, 4096),
    "gate/up_proj": (14336, 4096),
    "down_proj": (4096, 14336),
    "lm_head": (128256, 4096),
}


L2_BYTES = 256 << 20  # more than any GPU's L2 (the H200's is 50 MB)


def operands(n: int, k: int, m: int, group_size: int):
    """x, and copies of one random 4-bit weight (packed, scales, biases) that together exceed the L2."""
    w = mx.random.normal((n, k)).astype(mx.bfloat16)
    wq, scales, biases = mx.quantize(w, group_size=group_size, bits=4)
    x = mx.random.normal((m, k)).astype(mx.bfloat16)
    nbytes = wq.nbytes + scales.nbytes + biases.nbytes
    weights = [(wq, scales, biases)] + [(wq + 0, scales + 0, biases + 0) for _ in range(L2_BYTES // nbytes)]
    mx.eval(x, weights)
    return x, weights, nbytes


def timed(staged: bool, x, weights, group_size: int, calls: int) -> tuple[float, mx.array]:
    """Seconds a call, `calls` queued back to back over the weight's copies in turn; the first copy's output."""
    y = qmm.quantized_matmul(x, *weights[0], group_size, staged_kernel=staged)
    mx.eval(y)  # (a first call compiles)
    start = time.perf_counter()
    outs = [qmm.quantized_matmul(x, *weights[i % len(weights)], group_size, staged_kernel=staged) for i in range(calls)]
    mx.eval(outs)
    return (time.perf_counter() - start) / calls, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, nargs="+", default=[16, 32], help="rows of x (9..32)")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=40)
    args = parser.parse_args()
    if not (getattr(mx, "cuda", None) and mx.cuda.is_available()):
        sys.exit("qmm_ab.py: needs MLX's CUDA backend and a CUDA device")
    print(f"{'shape':>13} {'M':>3} | {'plain us':>9} {'GB/s':>6} | {'staged us':>9} {'GB/s':>6} | staged/plain | equal")
    for name in args.shapes:
        n, k = SHAPES[name]
        for m in args.m:
            x, weights, nbytes = operands(n, k, m, args.group_size)
            times: dict[bool, list[float]] = {False: [], True: []}
            outs = {}
            for _ in range(args.rounds):
                for staged in (False, True):
                    seconds, outs[staged] = timed(staged, x, weights, args.group_size, args.calls)
                    times[staged].append(seconds)
            plain, staged = statistics.median(times[False]), statistics.median(times[True])
            equal = mx.array_equal(outs[False], outs[True]).item()
            print(
                f"{name:>13} {m:>3} | {plain * 1e6:9.1f} {nbytes / plain / 1e9:6.0f} | {staged * 1e6:9.1f} "
                f"{nbytes / staged / 1e9:6.0f} | {plain / staged:11.3f}x | {equal}",
                flush=True,
            )


if __name__ == "__main__":
    main()
