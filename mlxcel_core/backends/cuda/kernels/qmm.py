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
the 4 consecutive K values k = t Q + 4 s .. k + 3 of them and of x row g of each tile: four to eight times fewer
load instructions than 16-bit pieces. The mma's fragments put the logical K index 2t, 2t+1 (registers a0a1, b0b1)
and 2t+8, 2t+9 (a4a5, b2b3) at a thread: this kernel maps those to the physical K values k, k+1 and k+2, k+3, the
same permutation on both operands, so the products pair up. The emulation in
tests/mlxcel_core/backends/cuda/kernels/test_qmm.py follows this mapping and the PTX fragment layouts index by index.

Data movement: a block's 4 warps (64 weight rows) share x. The block copies a chunk of it (all rows, CHUNK_K values
of K) into shared memory with cp.async, the next chunk copying while the warps compute on this one (two buffers);
rows are padded by 8 bytes, so a warp's 8-byte reads of 4 rows by 4 offsets hit 16 different bank pairs (no
conflict), and rows M .. 8 NT - 1 hold zeros. Each warp keeps D groups of its weights (words, scales, biases) in
flight in a ring of registers, loading a group D groups before its turn. Why: where each warp loads its own x from
global memory (8 bytes at a time, 8 rows by 4 offsets: 32 sectors touched, a quarter of each used) and a group's
weights only when the group starts, every warp waits a memory latency a group (benchmarks/RESULTS.md has the whole
decode step both ways).

Experiment (MLXCEL_QMM_XSUM, template XSUM, issue 42's target 2): the bias term needs each x row's sum over each
group, which every warp otherwise adds up from its own x fragments beside its products (many of the loop's
instructions in the compiled sm_90 code: benchmarks/qmm_sass.py counts them). With XSUM the block sums each staged chunk's rows once, into shared memory
behind a second barrier, and each warp reads two sums a tile; that variant is compiled with __launch_bounds__(128,
MIN_BLOCKS), at most 128 registers a thread, so four blocks fit an SM instead of three.

blockIdx.y splits K (SPLITS parts of GPS groups) so that narrow weights still fill the GPU; each split writes float32
partial sums [SPLITS, M, N], which are summed and cast after the launch.
"""

from __future__ import annotations

import functools
import hashlib

import mlx.core as mx

from mlxcel_core import settings

from . import qmv, qmv_source
from .cubin_cache import cuda_kernel
from .matvec_config import QMM_TARGET_BLOCKS as TARGET_BLOCKS  # noqa: F401
from .matvec_config import qmm_split_k as split_k  # the untuned rule

MAX_ROWS = 32  # rows of x one launch takes (4 tiles of 8)
WARPS = 4  # a block's warps, 16 weight rows each
ROWS_PER_BLOCK = 16 * WARPS
X_TYPES = (mx.bfloat16, mx.float16)
# (MLXCEL_QMM_XSUM's variant) blocks an SM: registers capped at 65536 / (128 * 4) = 128 a thread, which the variant
# needs no spill for; two waves of 3 blocks an SM take an 8B gate projection's 448 blocks otherwise
MIN_BLOCKS = 4
CHUNK_K = 256  # values of K a block stages in shared memory at a time (whole groups: 8, 4 or 2 of 32, 64 or 128)

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

// The same with each x row's group sum read from the block's sums (XSUM: `sums` = the group's NT * 8 sums in shared
// memory, x row m's at m): accumulator (i, j) takes x rows nt * 8 + 2t and 2t + 1, adjacent there, one 8-byte read.
template <int NT>
__device__ __forceinline__ void mlxcel_qmm_scale_sums(float (&tot)[NT][4], const float (&acc)[NT][4],
                                                      const float* sums, float s0, float s1, float c0, float c1,
                                                      int t) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const float2 xab = *reinterpret_cast<const float2*>(sums + nt * 8 + 2 * t);
        tot[nt][0] += s0 * acc[nt][0] + c0 * xab.x;
        tot[nt][1] += s0 * acc[nt][1] + c0 * xab.y;
        tot[nt][2] += s1 * acc[nt][2] + c1 * xab.x;
        tot[nt][3] += s1 * acc[nt][3] + c1 * xab.y;
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

// 8 bytes global -> shared, asynchronously (cp.async.ca: through L1, 8-byte granularity, sm_80+).
// (The shared-window address by PTX's cvta: no runtime-header intrinsic, which NVRTC may not declare.)
__device__ __forceinline__ void mlxcel_qmm_cp8(void* dst, const void* src) {
    unsigned at;
    asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }\n" : "=r"(at) : "l"(dst));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(at), "l"(src) : "memory");
}
"""
    + f"\n#define CHUNK_K {CHUNK_K}\n"
)

_SOURCE = r"""
    constexpr int STEPS = G / 16;  // mma k-steps a group
    constexpr int CG = CHUNK_K / G;  // groups a chunk
    constexpr int RS = CHUNK_K + 4;  // a staged row's 16-bit values: 8 bytes of padding (see the module docstring)
    constexpr int Q = G / 4;
    constexpr int WORDS = G / 32;
    constexpr int D = CG < 4 ? CG : 4;  // groups of weights a warp loads ahead (divides CG)
    __shared__ __align__(16) T xsh[2][NT * 8][RS];
    __shared__ __align__(16) float xsum[XSUM ? 2 : 1][XSUM ? CG : 1][NT * 8];  // (XSUM) each staged group's row sums
    int M = 1;
    for (int d = 0; d < x_ndim - 1; ++d) {
        M *= x_shape[d];
    }
    const int N = w_shape[0];
    const int KW = w_shape[1];
    const int K = KW * 8;
    const int NG = K / G;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int n0 = (blockIdx.x * 4 + warp) * 16;
    const bool live = n0 < N;  // a warp past the last row still stages and synchronizes with the block
    const int r0 = min(n0 + g, N - 1);
    const int r1 = min(n0 + g + 8, N - 1);
    const int gbeg = blockIdx.y * GPS;
    const int gend = min(gbeg + GPS, NG);
    const int chunks = (gend - gbeg + CG - 1) / CG;
    const uint32_t* w0 = w + size_t(r0) * KW;
    const uint32_t* w1 = w + size_t(r1) * KW;
    const bool whole = (reinterpret_cast<uintptr_t>(x) & 7u) == 0;  // else x is a view at an odd offset

    // Rows M .. NT * 8 - 1 of both buffers hold zeros (no copy writes them).
    for (int i = threadIdx.x; i < 2 * (NT * 8 - M) * RS; i += blockDim.x) {
        const int b = i / ((NT * 8 - M) * RS);
        const int r = i - b * (NT * 8 - M) * RS;
        xsh[b][M + r / RS][r % RS] = T(0.0f);
    }
    // Chunk c of this split's groups into buffer c % 2: 8-byte pieces, copied asynchronously where x is aligned.
    auto stage = [&](int c) {
        const int g0 = gbeg + c * CG;
        const int row_pieces = min(CG, gend - g0) * (G / 4);
        for (int p = threadIdx.x; p < M * row_pieces; p += blockDim.x) {
            const int m = p / row_pieces;
            const int j = p - m * row_pieces;
            const T* src = x + size_t(m) * K + size_t(g0) * G + 4 * j;
            T* dst = &xsh[c & 1][m][4 * j];
            if (whole) {
                mlxcel_qmm_cp8(dst, src);
            } else {
                dst[0] = src[0]; dst[1] = src[1]; dst[2] = src[2]; dst[3] = src[3];
            }
        }
        asm volatile("cp.async.commit_group;\n" ::: "memory");
    };

    float tot[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        tot[nt][0] = tot[nt][1] = tot[nt][2] = tot[nt][3] = 0.0f;
    }
    // Groups of weights in flight a warp: slot d of the ring holds group gbeg + d (mod D) (its words, scales and
    // biases); when a group's turn comes its slot is copied out and refilled with the group D further on.
    uint32_t rq0[D][WORDS], rq1[D][WORDS];
    float rsc[D][4];
    auto fetch = [&](int gg, uint32_t* q0, uint32_t* q1, float* sc) {
        mlxcel_qmm_words<WORDS>(q0, w0 + gg * (G / 8) + t * WORDS);
        mlxcel_qmm_words<WORDS>(q1, w1 + gg * (G / 8) + t * WORDS);
        sc[0] = static_cast<float>(scales[size_t(r0) * NG + gg]);
        sc[1] = static_cast<float>(scales[size_t(r1) * NG + gg]);
        sc[2] = static_cast<float>(biases[size_t(r0) * NG + gg]);
        sc[3] = static_cast<float>(biases[size_t(r1) * NG + gg]);
    };
#pragma unroll
    for (int d = 0; d < D; ++d) {
        if (gbeg + d < gend) {
            fetch(gbeg + d, rq0[d], rq1[d], rsc[d]);
        }
    }
    stage(0);
    for (int c = 0; c < chunks; ++c) {
        if (c + 1 < chunks) {
            stage(c + 1);
            asm volatile("cp.async.wait_group 1;\n" ::: "memory");
        } else {
            asm volatile("cp.async.wait_group 0;\n" ::: "memory");
        }
        __syncthreads();
        const int g0 = gbeg + c * CG;
        if constexpr (XSUM) {  // each x row's sum over each group of the chunk, once for the block's warps
            for (int i = threadIdx.x; i < min(CG, gend - g0) * NT * 8; i += blockDim.x) {
                const int gc = i / (NT * 8);
                const int m = i - gc * (NT * 8);
                const T* row = &xsh[c & 1][m][gc * G];
                float sum = 0.0f;
#pragma unroll
                for (int j = 0; j < G; j += 4) {
                    const uint2 v = *reinterpret_cast<const uint2*>(row + j);
                    sum += mlxcel_qmm_sum2<T>(v.x) + mlxcel_qmm_sum2<T>(v.y);
                }
                xsum[c & 1][gc][m] = sum;
            }
            __syncthreads();
        }
        for (int sb = 0; live && sb < CG; sb += D) {  // (D divides CG: group gi's slot is gi - g0 - sb)
#pragma unroll
            for (int d = 0; d < D; ++d) {
                const int gi = g0 + sb + d;
                if (gi >= gend) {
                    break;
                }
                uint32_t p0[WORDS], p1[WORDS];
                float ps[4];
#pragma unroll
                for (int i = 0; i < WORDS; ++i) {
                    p0[i] = rq0[d][i];
                    p1[i] = rq1[d][i];
                }
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    ps[i] = rsc[d][i];
                }
                if (gi + D < gend) {
                    fetch(gi + D, rq0[d], rq1[d], rsc[d]);
                }
                float acc[NT][4];
                float xs[NT];
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
                    xs[nt] = 0.0f;
                }
#pragma unroll
                for (int s = 0; s < STEPS; ++s) {
                    const uint32_t h0 = p0[s >> 1] >> (16 * (s & 1));
                    const uint32_t h1 = p1[s >> 1] >> (16 * (s & 1));
                    const int kc = (gi - g0) * G + t * Q + 4 * s;  // k within the chunk
                    uint32_t a[4];
                    a[0] = mlxcel_qmm_pair<T>(h0);
                    a[1] = mlxcel_qmm_pair<T>(h1);
                    a[2] = mlxcel_qmm_pair<T>(h0 >> 8);
                    a[3] = mlxcel_qmm_pair<T>(h1 >> 8);
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) {
                        const uint2 v = *reinterpret_cast<const uint2*>(&xsh[c & 1][nt * 8 + g][kc]);
                        uint32_t b[2] = {v.x, v.y};
                        if constexpr (!XSUM) {
                            xs[nt] += mlxcel_qmm_sum2<T>(b[0]) + mlxcel_qmm_sum2<T>(b[1]);
                        }
                        mlxcel_qmm_mma<T>(acc[nt], a, b);
                    }
                }
                if constexpr (XSUM) {
                    mlxcel_qmm_scale_sums<NT>(tot, acc, xsum[c & 1][gi - g0], ps[0], ps[1], ps[2], ps[3], t);
                } else {
                    mlxcel_qmm_scale<NT>(tot, acc, xs, ps[0], ps[1], ps[2], ps[3], t);
                }
            }
        }
        __syncthreads();  // every warp is done with this buffer before the next stage() refills it
    }
    if (!live) {
        return;
    }
    mlxcel_qmm_store<NT>(partial + size_t(blockIdx.y) * M * N, M, N, n0, g, t, tot);
"""

# The name carries a hash of the source: MLX caches compiled kernels on disk by name (see kernels/qmv.py).
KERNEL_NAME = f"mlxcel_qmm_mma_{hashlib.sha256((_HEADER + _SOURCE).encode()).hexdigest()[:8]}"


@functools.cache
def _kernel(bounded: bool = False):
    """The kernel; `bounded` (MLXCEL_QMM_XSUM's variant): its registers capped so that MIN_BLOCKS blocks fit an SM."""
    return cuda_kernel(
        name=KERNEL_NAME,
        input_names=["x", "w", "scales", "biases"],
        output_names=["partial"],
        source=_SOURCE,
        header=_HEADER,
        launch_bounds=(WARPS * 32, MIN_BLOCKS) if bounded else None,
    )


def kernel_source() -> tuple[str, str]:
    """(header, body) as MLX's cuda_kernel assembles them (the compile test's input)."""
    return _HEADER, _SOURCE


def chosen_gps(n: int, k: int, m: int, group_size: int, x_dtype) -> int:
    """Groups of K a split for a launch: the autotune cache's winner for this cell where MLXCEL_AUTOTUNE reads the
    cache and one is stored (`mlxcel tune --op qmm-splits`, autotune/matvec_ops.py), else `split_k`'s rule."""
    from autotune.matvec_ops import QMM, tuned_config

    tuned = tuned_config(QMM, n, k, m, group_size, "plain", x_dtype)
    return tuned[0] if tuned else split_k(n, k // group_size)[1]


@functools.cache
def xsum() -> bool:
    """MLXCEL_QMM_XSUM: each block sums x's rows over each staged group once, in shared memory, instead of every
    warp summing its own x fragments beside its products (the experiment's question: whether the fewer instructions
    a product takes outweigh a second barrier a chunk). Read once a process: a decode step launches the kernel for
    every 4-bit projection."""
    return settings.get("MLXCEL_QMM_XSUM")


@functools.lru_cache(maxsize=1024)
def launch_args(
    x_shape: tuple,
    x_dtype,
    s_dtype,
    n: int,
    k: int,
    group_size: int,
    gps: int | None = None,
    block_sums: bool | None = None,
) -> dict | None:
    """Everything but the inputs of one launch for x (any leading shape, 1..MAX_ROWS rows of K) and an N x K 4-bit
    weight, or None where the kernel does not take it (other types, group sizes, too many rows). `gps` (groups of K a
    split) overrides `chosen_gps`; `block_sums` overrides `xsum()`."""
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
        template=[
            ("T", x_dtype),
            ("S", s_dtype),
            ("G", group_size),
            ("NT", -(-m // 8)),
            ("GPS", gps),
            ("XSUM", xsum() if block_sums is None else block_sums),
        ],
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
    block_sums: bool | None = None,
) -> mx.array:
    """x @ dequantize(w, scales, biases).T on the kernel (CUDA only; the caller has checked `launch_args`), in
    mx.result_type(x, scales) like mx.quantized_matmul. `gps` overrides the groups of K a split, `block_sums` the
    MLXCEL_QMM_XSUM setting."""
    n, k = w.shape[0], w.shape[1] * 8
    args = launch_args(x.shape, x.dtype, scales.dtype, n, k, group_size, gps, block_sums)
    if args is None:
        raise ValueError(
            f"the 4-bit mma kernel takes 1..{MAX_ROWS} rows of bfloat16/float16 with K a multiple of "
            f"the group size, got x of shape {x.shape} and {x.dtype}, group size {group_size}"
        )
    partial = _kernel(dict(args["template"])["XSUM"])(inputs=[x, w, scales, biases], **args)[0]
    y = partial[0] if partial.shape[0] == 1 else partial.sum(axis=0)
    return y.astype(mx.result_type(x.dtype, scales.dtype)).reshape(*x.shape[:-1], n)
