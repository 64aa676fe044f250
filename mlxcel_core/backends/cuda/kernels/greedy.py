"""The end of an all-greedy decode step, each row's token and its NaN readout, in one CUDA launch.

    tokens, readout = greedy_tokens(logits)   # logits [N, V] -> uint32 [N], int32 [N]
    tokens, readout = masked_greedy_tokens(logits, bitmask)   # only the tokens each row's bitmask allows

`tokens` is each row's argmax (the first index of the largest logit, as mx.argmax), the next step's input;
`readout` is what the host reads: the token, or -1 where the row's logits hold a NaN (the engine ends that row).
As MLX ops that is an argmax, an isnan, an any, a cast and a select: on the H200 three launches and about 53 us a
1B token (arg_reduce 16 us, the NaN check's binary and row reduction 37 us; benchmarks/gpu_profile.py) and five
ops of host work. The kernel reads the logits once: one block per row, 16-byte loads, a running (max, index, NaN)
per thread, then warp shuffles and shared memory. Where it does not run (no CUDA device, or logits not [N, V] of a
float type) the MLX ops compute the same arrays.

The masked form is a constrained row's greedy step (engine/constrained.py): `bitmask` [N, words] int32, bit t % 32
of word t // 32 set where token t is allowed. The kernel passes over the tokens a row's mask leaves out, so it reads
the logits once and needs no masked copy of them: the argmax and the NaN readout of
`apply_bitmask(logits, bitmask)` in one launch.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from ..paged_attention import cuda_kernel_available
from .cubin_cache import cuda_kernel
from .qmv import FLOAT_TYPES

THREADS = 1024

_SOURCE = r"""
    constexpr int VEC = 16 / sizeof(T);
    const int row = blockIdx.x;
    const int tid = threadIdx.x;
    const int V = logits_shape[1];
    const T* x = logits + size_t(row) * V;
    float best = 0.0f;
    int idx = -1;  // none yet
    bool nan = false;
    ALLOWED_SETUP
    // Each thread sees its elements in increasing index order and keeps the first of equal maxima.
#define CONSIDER_VALUE(value, at)                  \
    if (ALLOWED(at)) {                             \
        const float v_ = (value);                  \
        nan = nan || isnan(v_);                    \
        if (idx < 0 || v_ > best) {                \
            best = v_;                             \
            idx = (at);                            \
        }                                          \
    }
    int scalar_from = 0;
    if (reinterpret_cast<size_t>(x) % 16 == 0) {
        const int chunks = V / VEC;
#pragma unroll 4
        for (int c = tid; c < chunks; c += TPB) {
            alignas(16) T vals[VEC];
            *reinterpret_cast<uint4*>(vals) = reinterpret_cast<const uint4*>(x)[c];
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                CONSIDER_VALUE(static_cast<float>(vals[j]), c * VEC + j);
            }
        }
        scalar_from = chunks * VEC;
    }
    for (int i = scalar_from + tid; i < V; i += TPB) {
        CONSIDER_VALUE(static_cast<float>(x[i]), i);
    }
#undef CONSIDER_VALUE

    // Larger value wins; equal values: the smaller index (mx.argmax's first maximum).
    __shared__ float s_best[32];
    __shared__ int s_idx[32];
    __shared__ int s_nan[32];
    const int lane = tid % 32;
    const int warp = tid / 32;
    for (int round = 0; round < 2; ++round) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, o);
            const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
            const int on = __shfl_xor_sync(0xffffffffu, int(nan), o);
            if (oi >= 0 && (idx < 0 || ov > best || (ov == best && oi < idx))) {
                best = ov;
                idx = oi;
            }
            nan = nan || on;
        }
        if (round == 1) {
            break;
        }
        if (lane == 0) {
            s_best[warp] = best;
            s_idx[warp] = idx;
            s_nan[warp] = int(nan);
        }
        __syncthreads();
        if (warp != 0) {
            return;
        }
        const bool has = lane < TPB / 32;
        best = has ? s_best[lane] : 0.0f;
        idx = has ? s_idx[lane] : -1;
        nan = has && s_nan[lane];
    }
    if (lane == 0) {
        tokens[row] = static_cast<uint32_t>(idx);
        readout[row] = nan ? -1 : idx;
    }
#undef ALLOWED
"""
_ALL = "\n#define ALLOWED(at) true\n"
# (the row's mask words; a token past them is not allowed)
_MASKED = """
    const int W = bitmask_shape[1];
    const int* words = bitmask + size_t(row) * W;
#define ALLOWED(at) (((at) >> 5) < W && ((words[(at) >> 5] >> ((at) & 31)) & 1))
"""


@functools.cache
def _kernel():
    return cuda_kernel(
        name="mlxcel_greedy_tokens",
        input_names=["logits"],
        output_names=["tokens", "readout"],
        source=_SOURCE.replace("ALLOWED_SETUP", _ALL),
    )


@functools.cache
def _masked_kernel():
    return cuda_kernel(
        name="mlxcel_masked_greedy_tokens",
        input_names=["logits", "bitmask"],
        output_names=["tokens", "readout"],
        source=_SOURCE.replace("ALLOWED_SETUP", _MASKED),
    )


def kernel_runs(logits: mx.array) -> bool:
    """Whether greedy_tokens launches the kernel for these logits (a CUDA device computing by default, [N, V] float
    logits with at least one column)."""
    return (
        cuda_kernel_available()
        and mx.default_device() == mx.gpu
        and logits.ndim == 2
        and logits.shape[0] >= 1
        and logits.shape[1] >= 1
        and logits.dtype in FLOAT_TYPES
    )


def readout_of(tokens: mx.array, logits: mx.array) -> mx.array:
    """int32 tokens [N], -1 in rows whose logits [N, V] hold a NaN (MLX ops)."""
    return mx.where(mx.isnan(logits).any(axis=-1), -1, tokens.astype(mx.int32))


def greedy_tokens(logits: mx.array) -> tuple[mx.array, mx.array]:
    """(tokens uint32 [N], readout int32 [N]) of logits [N, V]: each row's argmax, and it again or -1 where the row
    holds a NaN. One kernel launch where it runs, else MLX ops."""
    if kernel_runs(logits):
        return _launch(_kernel(), [logits])
    tokens = mx.argmax(logits, axis=-1)
    return tokens, readout_of(tokens, logits)


def masked_greedy_tokens(logits: mx.array, bitmask: mx.array) -> tuple[mx.array, mx.array]:
    """greedy_tokens of `apply_bitmask(logits, bitmask)` (bitmask int32 [N, words]): one kernel launch where it runs,
    else those MLX ops."""
    if kernel_runs(logits) and bitmask.dtype == mx.int32 and bitmask.ndim == 2 and bitmask.shape[0] == logits.shape[0]:
        return _launch(_masked_kernel(), [logits, bitmask])
    from mlxcel_core.engine.constrained import apply_bitmask

    return greedy_tokens(apply_bitmask(logits, bitmask))


def _launch(kernel, inputs: list[mx.array]) -> tuple[mx.array, mx.array]:
    n = inputs[0].shape[0]
    tokens, readout = kernel(
        inputs=inputs,
        template=[("T", inputs[0].dtype), ("TPB", THREADS)],
        grid=(n * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(n,), (n,)],
        output_dtypes=[mx.uint32, mx.int32],
    )
    return tokens, readout
