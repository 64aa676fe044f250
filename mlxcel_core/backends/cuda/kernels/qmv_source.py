"""The CUDA source of the decode matvec kernels (kernels/qmv.py explains the 4-bit one, kernels/hmv.py the 16-bit one;
this file is their text): the header, each weight kind's main loop and the reductions, assembled by kernel_source with
each mode's block rows, row map and epilogue (kernels/qmv_modes.py).
"""

from __future__ import annotations

import hashlib

from .hmv_source import _HEADER_HALF, _MAIN_HALF
from .pdl_prefetch import PREFETCH_HELPER, matvec_share, with_prefetch
from .qmv_modes import _NORM, _NORM_SCALE, MODES, base_mode  # noqa: F401  (base_mode: the kernels' import of it)

# Whether two types are one (also kernels/qmm.py's).
SAME_TYPE = r"""template <typename A, typename B>
struct mlxcel_qmv_same {
    static constexpr bool value = false;
};
template <typename A>
struct mlxcel_qmv_same<A, A> {
    static constexpr bool value = true;
};
"""

_HEADER = (
    r"""
// mx.result_type for {float16, bfloat16, float32}: the same type, else float32.
template <typename A, typename B>
struct mlxcel_qmv_result {
    using type = float;
};
template <typename A>
struct mlxcel_qmv_result<A, A> {
    using type = A;
};
"""
    + SAME_TYPE
    + r"""template <typename P>
struct mlxcel_qmv_pointee;
template <typename A>
struct mlxcel_qmv_pointee<A*> {
    using type = A;
};
template <typename A>
struct mlxcel_qmv_pointee<const A*> {
    using type = A;
};

// Output n of row m of [q; k; v] (NQ, NK, NK wide) into its array.
template <typename O>
__device__ __forceinline__ void mlxcel_qmv_store_qkv(O* q, O* k, O* v, int nq, int nk, int m, int n, O o) {
    if (n < nq) {
        q[size_t(m) * nq + n] = o;
    } else if (n < nq + nk) {
        k[size_t(m) * nk + (n - nq)] = o;
    } else {
        v[size_t(m) * nk + (n - nq - nk)] = o;
    }
}

// 16 bytes of packed weights (32 nibbles), streamed: read once, so marked evict-first.
__device__ __forceinline__ uint4 mlxcel_qmv_load_w(const uint32_t* p, bool vec) {
    if (vec) {
        return __ldcs(reinterpret_cast<const uint4*>(p));
    }
    return make_uint4(p[0], p[1], p[2], p[3]);
}

__device__ __forceinline__ uint32_t mlxcel_qmv_word(const uint4& v, int i) {
    return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

// Nibbles 0 and 4 of v (bits 0-3 and 16-19) as the floats (1024 + q0, 1024 + q4).
__device__ __forceinline__ float2 mlxcel_qmv_even(uint32_t v) {
    const uint32_t h = (v & 0x000F000Fu) | 0x64006400u;
    return __half22float2(*reinterpret_cast<const __half2*>(&h));
}

// Nibbles 1 and 5 of v (bits 4-7 and 20-23) as the floats (64 + q1, 64 + q5).
__device__ __forceinline__ float2 mlxcel_qmv_odd(uint32_t v) {
    const uint32_t h = (v & 0x00F000F0u) | 0x54005400u;
    return __half22float2(*reinterpret_cast<const __half2*>(&h));
}

// Eight consecutive activations as float; 16-byte loads when the row is aligned.
template <typename T>
__device__ __forceinline__ void mlxcel_qmv_load_x(const T* p, float* out, bool vec) {
    alignas(16) T t[8];
    if (vec) {
#pragma unroll
        for (int j = 0; j < int(8 * sizeof(T) / 16); ++j) {
            reinterpret_cast<uint4*>(t)[j] = reinterpret_cast<const uint4*>(p)[j];
        }
    } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            t[j] = p[j];
        }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        out[j] = static_cast<float>(t[j]);
    }
}
"""
)

_MAIN_Q4 = r"""
    // One int template argument carries the launch configuration (fewer arguments: less host time per call).
    constexpr int M = CFG & 15;  // rows of x
    constexpr int GS = (CFG >> 4) & 255;  // group size
    constexpr int ROWS = (CFG >> 12) & 15;  // output rows per block
    constexpr int WARPS = (CFG >> 16) & 15;  // warps per block (splitting K)
    constexpr int UNROLL = (CFG >> 20) & 15;  // chunks per lane whose loads are in flight together
/*GROUP_IDS*/
    using OUT = typename mlxcel_qmv_result<T, S>::type;  // mx.result_type(x, scales)
    // A float32 output removes the offsets per element (exact): per chunk, their cancellation costs ~1e-5 of
    // |x| @ |W|.T, below fp16/bf16 rounding but 100x float32's.
    constexpr bool EXACT = mlxcel_qmv_same<OUT, float>::value;
    static_assert(mlxcel_qmv_same<OUT, typename mlxcel_qmv_pointee<decltype(/*OUT0*/)>::type>::value,
                  "output dtype must be mx.result_type(x, scales)");
    constexpr int CHUNK = 32;
    constexpr int STRIDE = WARPS * 32 * CHUNK;  // K covered by one round of the block's lanes
    const int N = w_shape[0];
    const int K = w_shape[1] * 8;  // x is M rows of K (any leading shape: only its data is read)
    const int KW = K / 8;  // packed words per weight row
    const int G = K / GS;  // groups per weight row
/*ROWS_OF_BLOCK*/

    const bool w_vec = (reinterpret_cast<size_t>(w) & 15) == 0;  // rows are K/2 bytes apart: 16-byte multiples
    const bool x_vec = (reinterpret_cast<size_t>(x) & 15) == 0;
/*NORM_DECL*/

    const uint32_t* w_row[ROWS];
    const S* s_row[ROWS];
    const S* b_row[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
/*ROW_MAP*/
        w_row[r] = w + n * KW;
        s_row[r] = scales + n * G;
        b_row[r] = biases + n * G;
    }

    float acc[ROWS][M];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
            acc[r][m] = 0.0f;
        }
    }

    for (int k0 = (wid * 32 + lane) * CHUNK; k0 < K; k0 += UNROLL * STRIDE) {
        // Every load of the UNROLL chunks first (weights, scales, biases), then the arithmetic.
        uint4 q[UNROLL][ROWS];
        float s[UNROLL][ROWS];
        float b[UNROLL][ROWS];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int k = k0 + u * STRIDE;
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                if (k < K) {
                    q[u][r] = mlxcel_qmv_load_w(w_row[r] + k / 8, w_vec);
                    s[u][r] = static_cast<float>(s_row[r][k / GS]);
                    b[u][r] = static_cast<float>(b_row[r][k / GS]);
                } else {
                    q[u][r] = make_uint4(0u, 0u, 0u, 0u);
                    s[u][r] = 0.0f;
                    b[u][r] = 0.0f;
                }
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int k = k0 + u * STRIDE;
            if (k < K) {
                float part[ROWS][M];  // sum over the chunk of x * (offset + q)
                float xs[M];  // sum of x over the chunk
                float xo[M];  // sum of x * offset over the chunk
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    xs[m] = 0.0f;
                    xo[m] = 0.0f;
#pragma unroll
                    for (int r = 0; r < ROWS; ++r) {
                        part[r][m] = 0.0f;
                    }
                }
#pragma unroll
                for (int i = 0; i < 4; ++i) {  // word i of the uint4: elements k + 8i .. k + 8i + 7
                    float xv[M][8];
/*NORM_G*/
#pragma unroll
                    for (int m = 0; m < M; ++m) {
                        mlxcel_qmv_load_x(x + size_t(m) * K + k + 8 * i, xv[m], x_vec);
/*NORM_X*/
                        const float se = (xv[m][0] + xv[m][2]) + (xv[m][4] + xv[m][6]);
                        const float so = (xv[m][1] + xv[m][3]) + (xv[m][5] + xv[m][7]);
                        xs[m] += se + so;
                        if (!EXACT) {
                            xo[m] = fmaf(1024.0f, se, fmaf(64.0f, so, xo[m]));
                        }
                    }
#pragma unroll
                    for (int r = 0; r < ROWS; ++r) {
                        const uint32_t word = mlxcel_qmv_word(q[u][r], i);
                        const uint32_t w8 = word >> 8;
                        float2 v04 = mlxcel_qmv_even(word);  // elements 0, 4 (offset 1024)
                        float2 v15 = mlxcel_qmv_odd(word);  // elements 1, 5 (offset 64)
                        float2 v26 = mlxcel_qmv_even(w8);  // elements 2, 6 (offset 1024)
                        float2 v37 = mlxcel_qmv_odd(w8);  // elements 3, 7 (offset 64)
                        if (EXACT) {  // (O + q) - O is exact in float32
                            v04 = make_float2(v04.x - 1024.0f, v04.y - 1024.0f);
                            v15 = make_float2(v15.x - 64.0f, v15.y - 64.0f);
                            v26 = make_float2(v26.x - 1024.0f, v26.y - 1024.0f);
                            v37 = make_float2(v37.x - 64.0f, v37.y - 64.0f);
                        }
#pragma unroll
                        for (int m = 0; m < M; ++m) {
                            float p = part[r][m];
                            p = fmaf(xv[m][0], v04.x, p);
                            p = fmaf(xv[m][1], v15.x, p);
                            p = fmaf(xv[m][2], v26.x, p);
                            p = fmaf(xv[m][3], v37.x, p);
                            p = fmaf(xv[m][4], v04.y, p);
                            p = fmaf(xv[m][5], v15.y, p);
                            p = fmaf(xv[m][6], v26.y, p);
                            p = fmaf(xv[m][7], v37.y, p);
                            part[r][m] = p;
                        }
                    }
                }
#pragma unroll
                for (int r = 0; r < ROWS; ++r) {
#pragma unroll
                    for (int m = 0; m < M; ++m) {
                        acc[r][m] = fmaf(s[u][r], part[r][m] - xo[m], fmaf(b[u][r], xs[m], acc[r][m]));
                    }
                }
            }
        }
    }
"""

# Shared by both main loops: the block's threads as GROUPS independent groups of WARPS warps. A group is what the
# kernels call a block: it takes ROWS rows (its logical block `lblock`) and its warps split K. GROUPS > 1 puts several
# such groups in one CUDA block, so a launch of one-warp groups (each warp streams whole rows) is not capped at 32
# blocks of one warp per SM.
_GROUP_IDS = """    constexpr int GROUPS = (CFG >> 24) & 15;  // independent groups of WARPS warps per CUDA block
    static_assert(GROUPS >= 1, "GROUPS >= 1");
    // (GROUPS == 1: the plain block, its ids compile-time simple)
    const int gtid = GROUPS == 1 ? int(threadIdx.x) : int(threadIdx.x % (WARPS * 32));  // the thread in its group
    const int grp = GROUPS == 1 ? 0 : int(threadIdx.x / (WARPS * 32));
    const int lblock = blockIdx.x * GROUPS + grp;  // the group's logical block: which rows it takes
    const int lane = threadIdx.x & 31;
    const int wid = gtid >> 5;  // the warp in its group"""

# Shared by both weight kinds: the reductions and the mode's epilogue.
_TAIL = r"""
    // Sum over the warp's lanes, then over the group's warps; one write per (row of x, output).
    __shared__ float red_all[GROUPS][WARPS][ROWS * M];
    float (&red)[WARPS][ROWS * M] = red_all[grp];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float v = acc[r][m];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                v += __shfl_xor_sync(0xffffffffu, v, o);
            }
            if (lane == 0) {
                red[wid][r * M + m] = v;
            }
        }
    }
/*NORM_REDUCE*/
    if (GROUPS > 1 && WARPS == 1) {
        __syncwarp();  // each group is one warp: no other warp reads its sums
    } else {
        __syncthreads();
    }
/*EPILOGUE*/
"""

WEIGHTS = ("q4", "half")  # 4-bit affine (w, scales, biases) or 16-bit (w)


def header(weights: str = "q4", early: int = 0) -> str:  # (early: kernel_source's)
    text = _HEADER if weights == "q4" else _HEADER + _HEADER_HALF
    return text + PREFETCH_HELPER + matvec_share(early) if early else text


def kernel_source(mode: str = "plain", weights: str = "q4", early: int = 0) -> str:
    """The kernel body for `mode` and `weights`: plain y = x @ w.T; qkv the same split into three outputs by weight
    row ranges (template ints NQ, NK); swiglu silu(x @ gate.T) * (x @ up.T) for w = [gate; up]; residual y =
    residual + x @ w.T (residual [M, N], of the output's dtype); qkv_norm and swiglu_norm the same of rms_norm(x).
    `early` (bytes a launch, 0: none): the block's weights asked of L2 before the wait for the previous kernel
    (MLXCEL_PDL_PREFETCH; the header carries the budget)."""
    _, outputs, block_rows, row_map, epilogue = MODES[mode]
    body = (_MAIN_Q4 if weights == "q4" else _MAIN_HALF) + _TAIL
    body = with_prefetch(body, weights) if early else body
    source = (
        body.replace("/*OUT0*/", outputs[0])
        .replace("/*GROUP_IDS*/", _GROUP_IDS)
        .replace("/*ROWS_OF_BLOCK*/", block_rows)
        .replace("/*ROW_MAP*/", row_map)
        .replace("/*EPILOGUE*/", epilogue)
    )
    norm = "_norm" in mode
    for marker, code in {**_NORM, **_NORM_SCALE}.items():
        source = source.replace(marker + "\n", code + "\n" if norm else "")
    return source.replace("/*KX*/", "k + 8 * i" if weights == "q4" else "k")  # the x chunk's first element


def kernel_name(mode: str = "plain", weights: str = "q4", early: int = 0) -> str:
    """Carries a hash of the source: MLX caches compiled kernels on disk by name."""
    text = f"{header(weights, early)}{kernel_source(mode, weights, early)}"
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    kind = "qmv" if weights == "q4" else "hmv"
    return f"mlxcel_{kind}_{digest}" if mode == "plain" else f"mlxcel_{kind}_{mode}_{digest}"


KERNEL_NAME = kernel_name()
