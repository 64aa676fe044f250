"""kernels/qmm.py's tensor-core 4-bit product with its data movement changed, not its arithmetic: an experiment
(MLXCEL_QMM_STAGED=1) until the H200 A/B at batch 32 decides which kernel stays.

Why: in qmm.py every warp loads its own copy of x from global memory, 8 bytes at a time, 8 rows by 4 offsets a load
(32 sectors touched, a quarter of each used), and a group's weights are loaded only when the group starts, so each
warp waits a memory latency a group. Here a block's 4 warps share x: the block copies a chunk of it (all rows,
CHUNK_K values of K) into shared memory with cp.async, the next chunk copying while the warps compute on this one
(two buffers); rows are padded by 8 bytes, so a warp's 8-byte reads of 4 rows by 4 offsets hit 16 different bank
pairs (no conflict). And each warp keeps D groups of its weights (words, scales, biases) in flight in a ring of
registers, loading a group D groups before its turn, where qmm.py waits for each group's load.

The per-warp arithmetic is qmm.py's, step for step (same fragments, same mma order, same scaling; rows of x past M
read zeros from shared memory where qmm.py passes zeros), so the outputs are qmm.py's up to how the compiler
contracts a multiply-add (tests/mlxcel_core/backends/cuda/kernels/test_qmm.py: within one unit in the last place).
Same launch: grid, block, splits and output.
"""

from __future__ import annotations

import functools
import hashlib

CHUNK_K = 256  # values of K a staged chunk (whole groups: 8, 4 or 2 of 32, 64 or 128)

_HEADER = r"""
// 8 bytes global -> shared, asynchronously (cp.async.ca: through L1, 8-byte granularity, sm_80+).
// (The shared-window address by PTX's cvta: no runtime-header intrinsic, which NVRTC may not declare.)
__device__ __forceinline__ void mlxcel_qmm_cp8(void* dst, const void* src) {
    unsigned at;
    asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }\n" : "=r"(at) : "l"(dst));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(at), "l"(src) : "memory");
}
"""

_SOURCE = r"""
    constexpr int STEPS = G / 16;  // mma k-steps a group
    constexpr int CG = CHUNK_K / G;  // groups a chunk
    constexpr int RS = CHUNK_K + 4;  // a staged row's 16-bit values: 8 bytes of padding (see the module docstring)
    constexpr int Q = G / 4;
    constexpr int WORDS = G / 32;
    constexpr int D = CG < 4 ? CG : 4;  // groups of weights a warp loads ahead (divides CG)
    __shared__ __align__(16) T xsh[2][NT * 8][RS];
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
                        xs[nt] += mlxcel_qmm_sum2<T>(b[0]) + mlxcel_qmm_sum2<T>(b[1]);
                        mlxcel_qmm_mma<T>(acc[nt], a, b);
                    }
                }
                mlxcel_qmm_scale<NT>(tot, acc, xs, ps[0], ps[1], ps[2], ps[3], t);
            }
        }
        __syncthreads();  // every warp is done with this buffer before the next stage() refills it
    }
    if (!live) {
        return;
    }
    mlxcel_qmm_store<NT>(partial + size_t(blockIdx.y) * M * N, M, N, n0, g, t, tot);
"""


def kernel_source(qmm_header: str) -> tuple[str, str]:
    """(header, body) of the staged kernel: qmm.py's helpers (`qmm_header`), the copy helper, CHUNK_K."""
    return qmm_header + _HEADER + f"\n#define CHUNK_K {CHUNK_K}\n", _SOURCE


@functools.cache
def kernel_name(qmm_header: str) -> str:
    """The name carries a hash of the whole source (MLX and our cubin cache key compiled kernels by name)."""
    header, body = kernel_source(qmm_header)
    return f"mlxcel_qmm_staged_{hashlib.sha256((header + body).encode()).hexdigest()[:8]}"
