"""Would a persistent kernel pay at 1B? Three chained bf16 matvecs (the MLP block's o_proj -> gate -> down shapes)
as three launches, against one launch whose blocks meet at a grid-wide barrier between the stages (CUDA only).

    python benchmarks/grid_barrier.py                 # Llama-3.2-1B shapes, 132 blocks (the H200's SMs)
    python benchmarks/grid_barrier.py --blocks 264 --iters 400

Why: the 1B decode step is bound by MLX's host cost per kernel launch (970 us of a 1.4 ms token went to encoding
104 launches, about 9 us each, in the twelfth session's host profile; 88 launches a token now), and every launch a
layer could lose needs all of a vector before the next matvec (a norm, a residual): a barrier across the grid. A
barrier needs every block resident at once, so the launch has at most one block per SM (--blocks must not exceed
the SM count: past it, the kernel would wait forever).

Each stage's rows are one warp's dot product each, the same code in both variants, so the outputs must be equal bit
for bit (checked). Timed: `--iters` chained iterations (stage 3's output is the next input) built and evaluated
together, i.e. host encoding and GPU time as a decode step sees them; the mean per iteration, best of --rounds.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import mlx.core as mx

# One warp's dot product of a bf16 row with a bf16 vector, float32 accumulation, 8 elements (16 bytes) a load; the
# vector through the L2 only (`__ldcg`) where other blocks wrote it in this launch.
_HEADER = r"""
template <bool FROM_L2>
__device__ __forceinline__ float mlxcel_gb_dot(const __nv_bfloat16* w, const __nv_bfloat16* x, int k, int lane) {
    float acc = 0.0f;
    for (int i = lane * 8; i < k; i += 32 * 8) {
        const uint4 wv = __ldcs(reinterpret_cast<const uint4*>(w + i));
        const uint4* xp16 = reinterpret_cast<const uint4*>(x + i);
        const uint4 xv = FROM_L2 ? __ldcg(xp16) : *xp16;
        const __nv_bfloat162* wp = reinterpret_cast<const __nv_bfloat162*>(&wv);
        const __nv_bfloat162* xp = reinterpret_cast<const __nv_bfloat162*>(&xv);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float2 a = __bfloat1622float2(wp[j]);
            const float2 b = __bfloat1622float2(xp[j]);
            acc = fmaf(a.x, b.x, acc);
            acc = fmaf(a.y, b.y, acc);
        }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        acc += __shfl_xor_sync(0xffffffffu, acc, off);
    }
    return acc;
}

// Rows n = first, first + step, ... of y = W x, W [rows, k]: one warp a row.
template <bool FROM_L2>
__device__ __forceinline__ void mlxcel_gb_rows(const __nv_bfloat16* w, const __nv_bfloat16* x, __nv_bfloat16* y,
                                               int rows, int k, int first, int step, int lane) {
    for (int n = first; n < rows; n += step) {
        const float v = mlxcel_gb_dot<FROM_L2>(w + size_t(n) * k, x, k, lane);
        if (lane == 0) {
            y[n] = __float2bfloat16(v);
        }
    }
}

// Every block of the grid arrives before any leaves. `bar[0]` counts arrivals over the launch (the k-th barrier
// waits for k * gridDim.x); the blocks must all be resident (at most one a SM).
__device__ __forceinline__ void mlxcel_gb_barrier(unsigned int* bar, unsigned int target) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();  // this block's outputs, visible before it counts itself in
        atomicAdd(bar, 1u);
        while (atomicAdd(bar, 0u) < target) {
            __nanosleep(20);
        }
        __threadfence();
    }
    __syncthreads();
}
"""

_SEPARATE = r"""
    constexpr int WARPS = 8;
    const int lane = threadIdx.x & 31;
    mlxcel_gb_rows<false>(w, x, y, N, K, blockIdx.x * WARPS + (threadIdx.x >> 5), gridDim.x * WARPS, lane);
"""

_PERSISTENT = r"""
    constexpr int WARPS = 8;
    const int lane = threadIdx.x & 31;
    const int first = blockIdx.x * WARPS + (threadIdx.x >> 5);
    const int step = gridDim.x * WARPS;
    unsigned int* bar = const_cast<unsigned int*>(barrier);  // zeros in, zeros out (the last block resets them)
    mlxcel_gb_rows<false>(w1, x, y1, N1, K1, first, step, lane);
    mlxcel_gb_barrier(bar, gridDim.x);
    mlxcel_gb_rows<true>(w2, y1, y2, N2, N1, first, step, lane);
    mlxcel_gb_barrier(bar, 2 * gridDim.x);
    mlxcel_gb_rows<true>(w3, y2, y3, N3, N2, first, step, lane);
    __syncthreads();
    if (threadIdx.x == 0) {  // every block is past its last wait once all have counted out: reset for the next launch
        if (atomicAdd(bar + 1, 1u) == gridDim.x - 1) {
            atomicExch(bar, 0u);
            atomicExch(bar + 1, 0u);
        }
    }
"""


@functools.cache
def _kernels():
    separate = mx.fast.cuda_kernel(name="mlxcel_gb_separate", input_names=["x", "w"], output_names=["y"],
                                   source=_SEPARATE, header=_HEADER)
    persistent = mx.fast.cuda_kernel(name="mlxcel_gb_persistent", input_names=["x", "w1", "w2", "w3", "barrier"],
                                     output_names=["y1", "y2", "y3"], source=_PERSISTENT, header=_HEADER)
    return separate, persistent


def separate_step(x, weights):
    kernel, _ = _kernels()
    for w in weights:
        n, k = w.shape
        x = kernel(inputs=[x, w], template=[("N", n), ("K", k)], grid=(-(-n // 8) * 256, 1, 1),
                   threadgroup=(256, 1, 1), output_shapes=[(n,)], output_dtypes=[mx.bfloat16])[0]
    return x


def persistent_step(x, weights, barrier, blocks: int):
    _, kernel = _kernels()
    (n1, k1), (n2, _), (n3, _) = (w.shape for w in weights)
    template = [("N1", n1), ("K1", k1), ("N2", n2), ("N3", n3)]
    return kernel(inputs=[x, *weights, barrier], template=template, grid=(blocks * 256, 1, 1),
                  threadgroup=(256, 1, 1), output_shapes=[(n1,), (n2,), (n3,)], output_dtypes=[mx.bfloat16] * 3)[2]


def timed(step, x, iters: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        y = x
        start = time.perf_counter()
        for _ in range(iters):
            y = step(y)
        mx.eval(y)
        best = min(best, (time.perf_counter() - start) / iters)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--blocks", type=int, default=132, help="persistent grid: at most one block a SM (H200: 132)")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if mx.default_device().type != mx.DeviceType.gpu or not mx.cuda.is_available():
        print("grid_barrier.py needs MLX's CUDA backend and a CUDA device", file=sys.stderr)
        return 2
    h, i = args.hidden, args.intermediate
    if h % 256 or i % 256:
        print("--hidden and --intermediate must be multiples of 256 (a warp's 8-element loads)", file=sys.stderr)
        return 2
    key = mx.random.key(0)
    k1, k2, k3, k4 = mx.random.split(key, 4)
    # Scaled so that every stage keeps unit variance: the chained iterations neither vanish nor overflow.
    weights = [(mx.random.normal((n, k), key=kk) / k**0.5).astype(mx.bfloat16)
               for (n, k), kk in (((h, h), k1), ((i, h), k2), ((h, i), k3))]
    x = mx.random.normal((h,), key=k4).astype(mx.bfloat16)
    barrier = mx.zeros((4,), mx.uint32)  # 16 bytes: outside MLX's small-block pool (cuda_small_arrays.py)
    mx.eval(weights, x, barrier)

    want = separate_step(x, weights)
    got = persistent_step(x, weights, barrier, args.blocks)
    again = persistent_step(got, weights, barrier, args.blocks)
    mx.eval(want, got, again, barrier)
    equal = mx.array_equal(want, got).item()
    chained = mx.array_equal(separate_step(got, weights), again).item()
    reset = not mx.any(barrier).item()
    print(f"stages: {h}x{h}, {i}x{h}, {h}x{i} bf16; persistent grid {args.blocks} blocks of 256 threads")
    print(f"persistent == separate bit for bit: {equal} (and on its own output: {chained}); barrier left at zero: "
          f"{reset}")
    if not (equal and chained and reset):
        return 1
    sep = timed(lambda y: separate_step(y, weights), x, args.iters, args.rounds)
    per = timed(lambda y: persistent_step(y, weights, barrier, args.blocks), x, args.iters, args.rounds)
    print(f"separate (3 launches): {sep * 1e6:.1f} us an iteration; persistent (1 launch, 2 barriers): "
          f"{per * 1e6:.1f} us ({sep / per:.2f}x); best of {args.rounds} rounds of {args.iters} chained iterations")
    return 0


if __name__ == "__main__":
    sys.exit(main())
