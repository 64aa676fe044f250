"""4-bit x 16-bit matrix product for decode batches (9..32 rows of x) on the tensor cores, as one CUDA kernel
(``mx.fast.cuda_kernel``), for the 4-bit layers of kernels/fast_linear.py.

Why: at a decode batch of B sequences MLX 0.32 reads every 4-bit weight B times (benchmarks/RESULTS.md), and
kernels/qmv.py's matvec kernel, whose float32 multiply-adds grow with the rows, stops at 8. Here each
weight is read once for all rows and the multiply-adds run as ``mma.sync.m16n8k16`` (float32 accumulation).

y[m, n] = sum over groups g of s[n, g] * (sum_k q[n, k] x[m, k]) + b[n, g] * (sum_k x[m, k]), k in group g: the
tensor cores take the raw nibbles q (0..15, exact in bf16 / fp16) against x, one group at a time, and each group's
sums are scaled after. No weight is ever rounded to 16 bits.

Layout of one warp's work: 16 weight rows (the mma's M) against 8 rows of x (its N) per tile, NT = ceil(M / 8) tiles
(NT is compiled in and M read from x's shape, so batch sizes 9..32 share three kernels); a k-step is 16 values of K,
a group G / 16 steps. Thread (g = lane / 4, t = lane % 4) owns the group's K values t Q .. t Q + Q - 1 (Q = G / 4)
of weight rows g and g + 8, loaded at once as G / 32 whole packed words a row (one vector load), and step s takes
the 4 consecutive K values k = t Q + 4 s .. k + 3 of them and of x row g of each tile (x four values at a time where
aligned): four to eight times fewer load instructions than 16-bit pieces (on the H200 an 8B 4-bit batch of 32
decodes at 1409 tok/s with these loads, 1085 with 16-bit pieces: benchmarks/RESULTS.md). The mma's fragments put the
logical K index 2t, 2t+1 (registers a0a1, b0b1) and 2t+8, 2t+9 (a4a5, b2b3) at a thread: this kernel maps those to
the physical K values k, k+1 and k+2, k+3, the same permutation on both operands, so the products pair up. The
emulation in tests/mlxcel_core/backends/cuda/kernels/test_qmm.py follows this mapping and the PTX fragment layouts
index by index.

A block is 4 warps (64 weight rows); blockIdx.y splits K (SPLITS parts of GPS groups) so that narrow weights still
fill the GPU; each split writes float32 partial sums [SPLITS, M, N], which are summed and cast after the launch.
"""

from __future__ import annotations

import functools
import hashlib

import mlx.core as mx

from mlxcel_core import settings

from . import qmm_staged, qmv, qmv_source
from .cubin_cache import cuda_kernel
from .matvec_config import QMM_TARGET_BLOCKS as TARGET_BLOCKS  # noqa: F401
from .matvec_config import qmm_split_k as split_k  # the untuned rule

MAX_ROWS = 32  # rows of x one launch takes (4 tiles of 8)
WARPS = 4  # a block's warps, 16 weight rows each
ROWS_PER_BLOCK = 16 * WARPS
X_TYPES = (mx.bfloat16, mx.float16)

_HEADER = (
    qmv_source.SAME_TYPE
    + r"""
// d += a (16 x 16, row) * b (16 x 8, col), float32 accumulators; T is the 16-bit type of a and b.
template <typename T>
__device__ __forceinline__ void mlxcel_qmm_mma(float* d, const uint32_t* a, const uint32_t* b) {
    if constexpr (mlxcel_qmv_same<T, __half>::value) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    } else {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
}

// Two nibbles (bits 0-3 and 4-7 of h) as a pair of T holding exactly q0 and q1: OR-ing a nibble into the mantissa
// of MAGIC gives OFF + q (bf16: 128 + q; fp16: 1024 + q), and OFF is then taken off, exactly, in 16 bits.
template <typename T>
__device__ __forceinline__ uint32_t mlxcel_qmm_pair(uint32_t h) {
    constexpr bool HALF = mlxcel_qmv_same<T, __half>::value;
    const uint32_t v = (h & 0xFu) | ((h & 0xF0u) << 12) | (HALF ? 0x64006400u : 0x43004300u);
    if constexpr (HALF) {
        __half2 r = __hsub2(*reinterpret_cast<const __half2*>(&v),
                            __half2(__float2half(1024.0f), __float2half(1024.0f)));
        return *reinterpret_cast<uint32_t*>(&r);
    } else {
        __nv_bfloat162 r = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&v),
                                   __nv_bfloat162(__float2bfloat16(128.0f), __float2bfloat16(128.0f)));
        return *reinterpret_cast<uint32_t*>(&r);
    }
}

// WORDS consecutive 32-bit words from p into r: one vector load where p is aligned to the vector's size (the
// caller's pointers are MLX's buffers plus an offset, so that is checked), single words otherwise.
template <int WORDS>
__device__ __forceinline__ void mlxcel_qmm_words(uint32_t* r, const uint32_t* p) {
    const uintptr_t at = reinterpret_cast<uintptr_t>(p);
    if constexpr (WORDS == 4) {
        if ((at & 15u) == 0) {
            const uint4 v = *reinterpret_cast<const uint4*>(p);
            r[0] = v.x; r[1] = v.y; r[2] = v.z; r[3] = v.w;
            return;
        }
    } else if constexpr (WORDS == 2) {
        if ((at & 7u) == 0) {
            const uint2 v = *reinterpret_cast<const uint2*>(p);
            r[0] = v.x; r[1] = v.y;
            return;
        }
    }
#pragma unroll
    for (int i = 0; i < WORDS; ++i) {
        r[i] = p[i];
    }
}

// A group's sums into the totals: weight rows g and g + 8 times their scales s0, s1, plus their biases c0, c1 times
// each x row's sum over the group (xs: this thread's part of x row nt * 8 + g's; two shuffles sum the quad's).
template <int NT>
__device__ __forceinline__ void mlxcel_qmm_scale(float (&tot)[NT][4], const float (&acc)[NT][4], const float (&xs)[NT],
                                                 float s0, float s1, float c0, float c1, int t) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        float v = xs[nt];
        v += __shfl_xor_sync(0xffffffffu, v, 1);
        v += __shfl_xor_sync(0xffffffffu, v, 2);
        // accumulator (i, j) = (weight row g or g + 8, x row nt * 8 + 2t or 2t + 1); quad 2t holds x row 2t's sum
        const float xa = __shfl_sync(0xffffffffu, v, 8 * t);
        const float xb = __shfl_sync(0xffffffffu, v, 8 * t + 4);
        tot[nt][0] += s0 * acc[nt][0] + c0 * xa;
        tot[nt][1] += s0 * acc[nt][1] + c0 * xb;
        tot[nt][2] += s1 * acc[nt][2] + c1 * xa;
        tot[nt][3] += s1 * acc[nt][3] + c1 * xb;
    }
}

// A warp's results into one split's partial sums [M, N]: accumulator (i, j) of tile nt is weight row n0 + g (+ 8)
// against x row nt * 8 + 2t (+ 1); rows past M and columns past N are dropped.
template <int NT>
__device__ __forceinline__ void mlxcel_qmm_store(float* out, int M, int N, int n0, int g, int t,
                                                 const float (&tot)[NT][4]) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const int ma = nt * 8 + 2 * t;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int m = ma + (i & 1);
            const int n = n0 + g + (i >> 1) * 8;
            if (m < M && n < N) {
                out[size_t(m) * N + n] = tot[nt][i];
            }
        }
    }
}

// The two T values packed in v, as floats, summed.
template <typename T>
__device__ __forceinline__ float mlxcel_qmm_sum2(uint32_t v) {
    if constexpr (mlxcel_qmv_same<T, __half>::value) {
        return __half2float(__ushort_as_half(static_cast<unsigned short>(v & 0xFFFFu)))
               + __half2float(__ushort_as_half(static_cast<unsigned short>(v >> 16)));
    } else {
        return __uint_as_float(v << 16) + __uint_as_float(v & 0xFFFF0000u);
    }
}
"""
)

_SOURCE = r"""
    constexpr int STEPS = G / 16;  // mma k-steps a group
    int M = 1;  // rows of x, at run time (NT is compiled in: batch sizes share kernels)
    for (int d = 0; d < x_ndim - 1; ++d) {
        M *= x_shape[d];
    }
    const int N = w_shape[0];
    const int KW = w_shape[1];  // packed words a weight row
    const int K = KW * 8;
    const int NG = K / G;  // groups a row
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int n0 = (blockIdx.x * 4 + warp) * 16;
    if (n0 >= N) {
        return;  // a whole warp past the last row (no block-wide synchronization follows)
    }
    const int r0 = min(n0 + g, N - 1);
    const int r1 = min(n0 + g + 8, N - 1);
    const int gbeg = blockIdx.y * GPS;
    const int gend = min(gbeg + GPS, NG);
    const uint32_t* w0 = w + size_t(r0) * KW;
    const uint32_t* w1 = w + size_t(r1) * KW;
    float tot[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        tot[nt][0] = tot[nt][1] = tot[nt][2] = tot[nt][3] = 0.0f;
    }
    for (int gi = gbeg; gi < gend; ++gi) {
        float acc[NT][4];
        float xs[NT];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
            xs[nt] = 0.0f;
        }
        // Thread t owns the group's K values t Q .. t Q + Q - 1 (Q = G / 4; G / 32 whole words a weight row, one
        // vector load) and step s takes t Q + 4 s + 0..3 of them: a bijection of the group's K values onto the mma's
        // logical K index, the same for both operands, so the products pair up and the group's sum is the same sum.
        constexpr int Q = G / 4;
        constexpr int WORDS = G / 32;
        uint32_t q0[WORDS], q1[WORDS];
        mlxcel_qmm_words<WORDS>(q0, w0 + gi * (G / 8) + t * WORDS);
        mlxcel_qmm_words<WORDS>(q1, w1 + gi * (G / 8) + t * WORDS);
#pragma unroll
        for (int s = 0; s < STEPS; ++s) {
            // nibbles 4 s .. 4 s + 3 of this thread's words: word s / 2, bits 16 (s % 2) ..
            const uint32_t h0 = q0[s >> 1] >> (16 * (s & 1));
            const uint32_t h1 = q1[s >> 1] >> (16 * (s & 1));
            const int k = gi * G + t * Q + 4 * s;
            uint32_t a[4];
            a[0] = mlxcel_qmm_pair<T>(h0);  // row g, logical K 2t, 2t+1 = physical k, k + 1
            a[1] = mlxcel_qmm_pair<T>(h1);  // row g + 8
            a[2] = mlxcel_qmm_pair<T>(h0 >> 8);  // row g, logical 2t+8, 2t+9 = physical k + 2, k + 3
            a[3] = mlxcel_qmm_pair<T>(h1 >> 8);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const int m = nt * 8 + g;
                uint32_t b[2] = {0u, 0u};
                if (m < M) {
                    const T* xk = x + size_t(m) * K + k;
                    if ((reinterpret_cast<uintptr_t>(xk) & 7u) == 0) {
                        const uint2 v = *reinterpret_cast<const uint2*>(xk);  // x[m, k .. k + 3] in one load
                        b[0] = v.x;
                        b[1] = v.y;
                    } else {
                        // 16-bit loads: x may start at any element (a view), so no wider alignment is assumed
                        const unsigned short* xp = reinterpret_cast<const unsigned short*>(xk);
                        b[0] = uint32_t(xp[0]) | (uint32_t(xp[1]) << 16);  // x[m, k], x[m, k + 1]: logical 2t, 2t+1
                        b[1] = uint32_t(xp[2]) | (uint32_t(xp[3]) << 16);  // x[m, k + 2], x[m, k + 3]: 2t+8, 2t+9
                    }
                    xs[nt] += mlxcel_qmm_sum2<T>(b[0]) + mlxcel_qmm_sum2<T>(b[1]);
                }
                mlxcel_qmm_mma<T>(acc[nt], a, b);
            }
        }
        const float s0 = static_cast<float>(scales[size_t(r0) * NG + gi]);
        const float s1 = static_cast<float>(scales[size_t(r1) * NG + gi]);
        const float c0 = static_cast<float>(biases[size_t(r0) * NG + gi]);
        const float c1 = static_cast<float>(biases[size_t(r1) * NG + gi]);
        mlxcel_qmm_scale<NT>(tot, acc, xs, s0, s1, c0, c1, t);
    }
    mlxcel_qmm_store<NT>(partial + size_t(blockIdx.y) * M * N, M, N, n0, g, t, tot);
"""

# The name carries a hash of the source: MLX caches compiled kernels on disk by name (see kernels/qmv.py).
KERNEL_NAME = f"mlxcel_qmm_mma_{hashlib.sha256((_HEADER + _SOURCE).encode()).hexdigest()[:8]}"


@functools.cache
def _kernel(staged: bool = False):
    header, source = kernel_source(staged)
    return cuda_kernel(
        name=kernel_name(staged),
        input_names=["x", "w", "scales", "biases"],
        output_names=["partial"],
        source=source,
        header=header,
    )


def kernel_source(staged: bool = False) -> tuple[str, str]:
    """(header, body) as MLX's cuda_kernel assembles them (the compile test's input); `staged`: qmm_staged.py's."""
    return qmm_staged.kernel_source(_HEADER) if staged else (_HEADER, _SOURCE)


def kernel_name(staged: bool = False) -> str:
    return qmm_staged.kernel_name(_HEADER) if staged else KERNEL_NAME


@functools.cache
def staged() -> bool:
    """MLXCEL_QMM_STAGED: the experiment's kernel (qmm_staged.py) in place of this one. Read once a process: a
    decode step calls the kernel for every 4-bit projection, and the setting costs microseconds a read."""
    return settings.get("MLXCEL_QMM_STAGED")


def chosen_gps(n: int, k: int, m: int, group_size: int, x_dtype) -> int:
    """Groups of K a split for a launch: the autotune cache's winner for this cell where MLXCEL_AUTOTUNE reads the
    cache and one is stored (`mlxcel tune --op qmm-splits`, autotune/matvec_ops.py), else `split_k`'s rule."""
    from autotune.matvec_ops import QMM, tuned_config

    tuned = tuned_config(QMM, n, k, m, group_size, "plain", x_dtype)
    return tuned[0] if tuned else split_k(n, k // group_size)[1]


@functools.lru_cache(maxsize=1024)
def launch_args(
    x_shape: tuple, x_dtype, s_dtype, n: int, k: int, group_size: int, gps: int | None = None
) -> dict | None:
    """Everything but the inputs of one launch for x (any leading shape, 1..MAX_ROWS rows of K) and an N x K 4-bit
    weight, or None where the kernel does not take it (other types, group sizes, too many rows). `gps` (groups of K a
    split) overrides `chosen_gps`."""
    m = qmv.rows_of(x_shape)
    if (
        not 1 <= m <= MAX_ROWS
        or x_dtype not in X_TYPES
        or group_size not in qmv.GROUP_SIZES
        or k % group_size
        or x_shape[-1] != k
        or s_dtype not in qmv.FLOAT_TYPES
    ):
        return None
    groups = k // group_size
    gps = gps or chosen_gps(n, k, m, group_size, x_dtype)
    splits = -(-groups // gps)
    return dict(
        template=[("T", x_dtype), ("S", s_dtype), ("G", group_size), ("NT", -(-m // 8)), ("GPS", gps)],
        grid=(-(-n // ROWS_PER_BLOCK) * WARPS * 32, splits, 1),
        threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(splits, m, n)],
        output_dtypes=[mx.float32],
    )


def quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int,
    gps: int | None = None,
    staged_kernel: bool | None = None,
) -> mx.array:
    """x @ dequantize(w, scales, biases).T on the kernel (CUDA only; the caller has checked `launch_args`), in
    mx.result_type(x, scales) like mx.quantized_matmul. `gps` overrides the groups of K a split; `staged_kernel`
    picks the kernel (None: `staged()`, the setting)."""
    n, k = w.shape[0], w.shape[1] * 8
    args = launch_args(x.shape, x.dtype, scales.dtype, n, k, group_size, gps)
    if args is None:
        raise ValueError(
            f"the 4-bit mma kernel takes 1..{MAX_ROWS} rows of bfloat16/float16 with K a multiple of "
            f"the group size, got x of shape {x.shape} and {x.dtype}, group size {group_size}"
        )
    partial = _kernel(staged() if staged_kernel is None else staged_kernel)(inputs=[x, w, scales, biases], **args)[0]
    y = partial[0] if partial.shape[0] == 1 else partial.sum(axis=0)
    return y.astype(mx.result_type(x.dtype, scales.dtype)).reshape(*x.shape[:-1], n)
