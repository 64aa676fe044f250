"""The CUDA text of the 4-bit batch kernel (kernels/qmm.py, whose docstring describes the design): the header's device
functions and the kernel body as ``mx.fast.cuda_kernel`` takes them, its template constants T (x's type), S (the
scales' and biases' type), G (group size), NT (8-row tiles of x), and GPS (groups of K a split)."""

from __future__ import annotations

from . import qmv_source

CHUNK_K = 256  # values of K a block stages in shared memory at a time (whole groups: 8, 4 or 2 of 32, 64 or 128);
# launches of more than 32 rows (NT > 4) stage half as many

# d += a b on the tensor cores (m16n8k16, float32 accumulators), for any 16-bit T: the 4-bit batch kernel's product,
# which the paged decode kernel's tensor-core body takes too (it needs qmv_source.SAME_TYPE before it).
MMA_M16N8K16 = r"""
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
"""

HEADER = (
    qmv_source.SAME_TYPE
    + MMA_M16N8K16
    + r"""
// Nibbles 0 and 4 of w (bits 0-3 and 16-19) as a pair of T holding exactly them: one AND-OR on the whole word puts
// them in the mantissas of two 16-bit OFF (bf16 128, fp16 1024), giving OFF + q0 | OFF + q1, and OFF is then taken
// off, exactly, in 16 bits.
template <typename T>
__device__ __forceinline__ uint32_t mlxcel_qmm_pair4(uint32_t w) {
    if constexpr (mlxcel_qmv_same<T, __half>::value) {
        const uint32_t v = (w & 0x000F000Fu) | 0x64006400u;
        __half2 r = __hsub2(*reinterpret_cast<const __half2*>(&v),
                            __half2(__float2half(1024.0f), __float2half(1024.0f)));
        return *reinterpret_cast<uint32_t*>(&r);
    } else {
        const uint32_t v = (w & 0x000F000Fu) | 0x43004300u;
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

// v in both halves of a pair of T (a group's scale or bias, made once a group).
template <typename T>
__device__ __forceinline__ uint32_t mlxcel_qmm_splat(float v) {
    if constexpr (mlxcel_qmv_same<T, __half>::value) {
        __half2 h = __float2half2_rn(v);
        return *reinterpret_cast<uint32_t*>(&h);
    }
    __nv_bfloat162 h = __float2bfloat162_rn(v);
    return *reinterpret_cast<uint32_t*>(&h);
}

// A pair of nibbles q (mlxcel_qmm_pair4) made weights q s + b in T, rounded once: where the scales and biases are T
// (s and b then exact in T), one fused multiply-add of pairs with s2 and b2 (s and b splat by mlxcel_qmm_splat);
// else (float32 scales) two float32 ones of s and b, then rounded. As a prompt's products read their dequantized
// weights (fast_linear.prompt_product) and MLX's quantized products do.
template <typename T, typename S>
__device__ __forceinline__ uint32_t mlxcel_qmm_dequant2(uint32_t q, uint32_t s2, uint32_t b2, float s, float b) {
    if constexpr (mlxcel_qmv_same<T, __half>::value) {
        const __half2 qh = *reinterpret_cast<const __half2*>(&q);
        __half2 r;
        if constexpr (mlxcel_qmv_same<S, T>::value) {
            r = __hfma2(qh, *reinterpret_cast<const __half2*>(&s2), *reinterpret_cast<const __half2*>(&b2));
        } else {
            const float2 qf = __half22float2(qh);
            r = __floats2half2_rn(fmaf(qf.x, s, b), fmaf(qf.y, s, b));
        }
        return *reinterpret_cast<uint32_t*>(&r);
    } else {
        const __nv_bfloat162 qh = *reinterpret_cast<const __nv_bfloat162*>(&q);
        __nv_bfloat162 r;
        if constexpr (mlxcel_qmv_same<S, T>::value) {
            r = __hfma2(qh, *reinterpret_cast<const __nv_bfloat162*>(&s2),
                        *reinterpret_cast<const __nv_bfloat162*>(&b2));
        } else {
            const float2 qf = __bfloat1622float2(qh);
            r = __floats2bfloat162_rn(fmaf(qf.x, s, b), fmaf(qf.y, s, b));
        }
        return *reinterpret_cast<uint32_t*>(&r);
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

SOURCE = r"""
    constexpr int STEPS = G / 16;  // mma k-steps a group
    constexpr int CK = NT > 4 ? CHUNK_K / 2 : CHUNK_K;  // values of K a chunk (half past 32 rows: 48 KiB of shared)
    constexpr int CG = CK / G;  // groups a chunk
    constexpr int RS = CK + 4;  // a staged row's 16-bit values: 8 bytes of padding (see the module docstring)
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
    const int n0 = (blockIdx.x * (blockDim.x >> 5) + warp) * 16;
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
        constexpr int PR = CG * (G / 4);  // pieces a whole chunk's row (a power of two: no division)
        const int row_pieces = min(CG, gend - g0) * (G / 4);
        for (int p = threadIdx.x; p < M * PR; p += blockDim.x) {
            const int m = p / PR;
            const int j = p % PR;
            if (j >= row_pieces) {
                continue;
            }
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
        {  // once for the block's warps: each 8 values x0..x7 of the chunk reordered x0 x4 x1 x5 x2 x6 x3 x7, to
            // pair with nibbles 4 apart (mlxcel_qmm_pair4)
            for (int i = threadIdx.x; i < min(CG, gend - g0) * NT * 8; i += blockDim.x) {
                const int gc = i / (NT * 8);
                const int m = i - gc * (NT * 8);
                T* row = &xsh[c & 1][m][gc * G];
#pragma unroll
                for (int j = 0; j < G; j += 8) {
                    const uint2 lo = *reinterpret_cast<const uint2*>(row + j);
                    const uint2 hi = *reinterpret_cast<const uint2*>(row + j + 4);
                    *reinterpret_cast<uint2*>(row + j) =
                        make_uint2(__byte_perm(lo.x, hi.x, 0x5410), __byte_perm(lo.x, hi.x, 0x7632));
                    *reinterpret_cast<uint2*>(row + j + 4) =
                        make_uint2(__byte_perm(lo.y, hi.y, 0x5410), __byte_perm(lo.y, hi.y, 0x7632));
                }
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
                float ps[4];  // the group's scales and biases of weight rows g and g + 8
#pragma unroll
                for (int i = 0; i < WORDS; ++i) {
                    p0[i] = rq0[d][i];
                    p1[i] = rq1[d][i];
                }
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    ps[i] = rsc[d][i];
                }
                // (both halves of a pair: the fused multiply-add's operands where the scales are T, made once a group)
                const uint32_t s0 = mlxcel_qmm_splat<T>(ps[0]), s1 = mlxcel_qmm_splat<T>(ps[1]);
                const uint32_t c0 = mlxcel_qmm_splat<T>(ps[2]), c1 = mlxcel_qmm_splat<T>(ps[3]);
                if (gi + D < gend) {
                    fetch(gi + D, rq0[d], rq1[d], rsc[d]);
                }
#pragma unroll
                for (int s = 0; s < STEPS; ++s) {
                    const int kc = (gi - g0) * G + t * Q + 4 * s;  // k within the chunk
                    // K values j, j + 4 and j + 1, j + 5 of the word, j = 2 (s & 1): x's order in shared memory
                    const uint32_t v0 = p0[s >> 1] >> (8 * (s & 1));
                    const uint32_t v1 = p1[s >> 1] >> (8 * (s & 1));
                    const uint32_t a[4] = {
                        mlxcel_qmm_dequant2<T, S>(mlxcel_qmm_pair4<T>(v0), s0, c0, ps[0], ps[2]),
                        mlxcel_qmm_dequant2<T, S>(mlxcel_qmm_pair4<T>(v1), s1, c1, ps[1], ps[3]),
                        mlxcel_qmm_dequant2<T, S>(mlxcel_qmm_pair4<T>(v0 >> 4), s0, c0, ps[0], ps[2]),
                        mlxcel_qmm_dequant2<T, S>(mlxcel_qmm_pair4<T>(v1 >> 4), s1, c1, ps[1], ps[3])};
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) {
                        const uint2 v = *reinterpret_cast<const uint2*>(&xsh[c & 1][nt * 8 + g][kc]);
                        const uint32_t b[2] = {v.x, v.y};
                        mlxcel_qmm_mma<T>(tot[nt], a, b);
                    }
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
