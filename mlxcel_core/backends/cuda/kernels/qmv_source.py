"""The CUDA source of the decode matvec kernels (kernels/qmv.py explains the 4-bit one, kernels/hmv.py the 16-bit one;
this file is their text): the header, each weight kind's main loop, the reductions and each mode's block rows, row
map and epilogue, assembled by kernel_source.
"""

from __future__ import annotations

import hashlib

from .hmv_source import _HEADER_HALF, _MAIN_HALF
from .pdl_prefetch import PREFETCH_HELPER, matvec_share, with_prefetch

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

# The block's weight rows: ROWS consecutive rows (plain and qkv), or ROWS / 2 rows of the gate half and the same rows
# of the up half (swiglu: the weight is [gate; up], N = 2 * NOUT). A block's rows past the end read the last row and
# write nothing.
_ROWS_CONSECUTIVE = """    const int n0 = lblock * ROWS;"""
_ROW_MAP_CONSECUTIVE = """        const size_t n = size_t(min(n0 + r, N - 1));"""
_ROWS_GATE_UP = """    constexpr int HALF = ROWS / 2;
    static_assert(ROWS % 2 == 0, "swiglu blocks take rows in gate/up pairs");
    const int NOUT = N / 2;
    const int n0 = lblock * HALF;  // first output (gate/up row pair) of this group"""
_ROW_MAP_GATE_UP = """        const int j = min(n0 + r % HALF, NOUT - 1);
        const size_t n = size_t(r < HALF ? j : NOUT + j);"""

# One output per weight row: the block's sums, then WRITE stores t, weight row n's output for row m of x.
_EPILOGUE_ROWS = """    for (int i = gtid; i < ROWS * M; i += WARPS * 32) {
        const int r = i / M;
        const int m = i % M;
        const int n = n0 + r;
        if (n < N) {
            float t = 0.0f;
#pragma unroll
            for (int v = 0; v < WARPS; ++v) {
                t += red[v][i];
            }
/*SCALE*/
/*WRITE*/
        }
    }"""
# y [M, N].
_EPILOGUE_PLAIN = _EPILOGUE_ROWS.replace("/*WRITE*/", "            y[size_t(m) * N + n] = static_cast<OUT>(t);")
# Weight rows [0, NQ) -> q_out [M, NQ], [NQ, NQ + NK) -> k_out [M, NK], the rest -> v_out [M, NK].
_EPILOGUE_QKV = _EPILOGUE_ROWS.replace(
    "/*WRITE*/", "            mlxcel_qmv_store_qkv(q_out, k_out, v_out, NQ, NK, m, n, static_cast<OUT>(t));"
)

# qkv with RoPE ("qkv_rope", "qkv_norm_rope"): a block takes ROWS / 2 rotation pairs, rows (h HD + i, h HD + i + HD/2)
# of one head (non-traditional RoPE rotates element i with element i + HD/2), over all of [q; k; v] (v's pairs are
# written unrotated). Each product is rounded to OUT first, as the separate matvec returns it; then, for q and k rows,
# (a, b) -> (a cos - b sin, b cos + a sin) with angle positions[m] * inv_freq[i] in float32 and one rounding, as
# mx.fast.rope computes it from the rounded q and k. positions [M] (float32: the row's position times the RoPE's
# scale), inv_freq [HD / 2] (float32). Template int HD (head_dim).
_ROWS_PAIRS = """    constexpr int HALF = ROWS / 2;
    static_assert(ROWS % 2 == 0, "rope blocks take rows in rotation pairs");
    const int NPAIR = N / 2;
    const int n0 = lblock * HALF;  // first rotation pair of this group"""
_ROW_MAP_PAIRS = """        const int p = min(n0 + r % HALF, NPAIR - 1);
        const size_t n = size_t((p / (HD / 2)) * HD + p % (HD / 2) + (r < HALF ? 0 : HD / 2));"""
_EPILOGUE_QKV_ROPE = """    for (int i = gtid; i < HALF * M; i += WARPS * 32) {
        const int r = i / M;
        const int m = i % M;
        const int p = n0 + r;
        if (p < NPAIR) {
            float a = 0.0f;
            float b = 0.0f;
#pragma unroll
            for (int v = 0; v < WARPS; ++v) {
                a += red[v][r * M + m];
                b += red[v][(r + HALF) * M + m];
            }
/*SCALE_AB*/
            a = static_cast<float>(static_cast<OUT>(a));
            b = static_cast<float>(static_cast<OUT>(b));
            const int j = p % (HD / 2);
            const int n = (p / (HD / 2)) * HD + j;
            float oa = a;
            float ob = b;
            if (n < NQ + NK) {  // q and k rotate; v does not
                const float angle = positions[m] * inv_freq[j];
                float s;
                float c;
                sincosf(angle, &s, &c);  // one range reduction for both
                oa = a * c - b * s;
                ob = b * c + a * s;
            }
            mlxcel_qmv_store_qkv(q_out, k_out, v_out, NQ, NK, m, n, static_cast<OUT>(oa));
            mlxcel_qmv_store_qkv(q_out, k_out, v_out, NQ, NK, m, n + HD / 2, static_cast<OUT>(ob));
        }
    }"""

# y [M, N] = residual + x @ w.T: the product rounded to OUT first, as the separate matvec returns it, then the add
# in float32 and one rounding to OUT, as a separate add computes it.
_EPILOGUE_RESIDUAL = _EPILOGUE_ROWS.replace(
    "/*WRITE*/",
    """            const size_t o = size_t(m) * N + n;
            y[o] = static_cast<OUT>(static_cast<float>(static_cast<OUT>(t)) + static_cast<float>(residual[o]));""",
)

# y [M, NOUT] = silu(gate) * up. gate and up are first rounded to OUT, as two separate matvecs would return them,
# then silu(g) * u = g * sigmoid(g) * u in float32 and one rounding (the unfused path rounds after every op).
_EPILOGUE_SWIGLU = """    for (int i = gtid; i < HALF * M; i += WARPS * 32) {
        const int r = i / M;
        const int m = i % M;
        const int j = n0 + r;
        if (j < NOUT) {
            float g = 0.0f;
            float u = 0.0f;
#pragma unroll
            for (int v = 0; v < WARPS; ++v) {
                g += red[v][r * M + m];
                u += red[v][(r + HALF) * M + m];
            }
/*SCALE_GU*/
            g = static_cast<float>(static_cast<OUT>(g));
            u = static_cast<float>(static_cast<OUT>(u));
            y[size_t(m) * NOUT + j] = static_cast<OUT>(g / (1.0f + expf(-g)) * u);
        }
    }"""

# The "_norm" modes take the RMSNorm before the projection into the launch: x is the raw hidden state, norm_w [K] the
# norm's weight, the template int EPS_BITS its epsilon's float32 bits (a constant, not a [1] input: see
# cuda_small_arrays.py).
# W (g * x * r) = r * W (g * x) with r = rsqrt(mean(x^2) + eps): the
# lanes multiply x by g as they load it and sum x^2 on the way (a block's lanes cover every element of K once, so
# the block sums whole rows), and the epilogue scales each sum by r. Unlike MLX's rms_norm, the normalized x is never
# rounded to the input dtype: closer to the exact value than the separate norm and matvec, so not bit-identical.
_NORM = {
    "/*NORM_DECL*/": """    const bool g_vec = (reinterpret_cast<size_t>(norm_w) & 15) == 0;
    float sq[M];  // this lane's share of each row's sum of squares
#pragma unroll
    for (int m = 0; m < M; ++m) {
        sq[m] = 0.0f;
    }""",
    "/*NORM_G*/": """                    float gv[8];  // the norm's weight over these eight elements
                    mlxcel_qmv_load_x(norm_w + /*KX*/, gv, g_vec);""",
    "/*NORM_X*/": """#pragma unroll
                        for (int j = 0; j < 8; ++j) {
                            sq[m] = fmaf(xv[m][j], xv[m][j], sq[m]);
                            xv[m][j] *= gv[j];
                        }""",
    "/*NORM_REDUCE*/": """    __shared__ float red_sq_all[GROUPS][WARPS][M];
    float (&red_sq)[WARPS][M] = red_sq_all[grp];
#pragma unroll
    for (int m = 0; m < M; ++m) {
        float v = sq[m];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            v += __shfl_xor_sync(0xffffffffu, v, o);
        }
        if (lane == 0) {
            red_sq[wid][m] = v;
        }
    }""",
}
_RNORM = """            float ssq = 0.0f;
#pragma unroll
            for (int v = 0; v < WARPS; ++v) {
                ssq += red_sq[v][m];
            }
            const float rn = rsqrtf(ssq / float(K) + __int_as_float(EPS_BITS));  // row m's RMSNorm factor
"""
_NORM_SCALE = {
    "/*SCALE*/": _RNORM + "            t *= rn;",
    "/*SCALE_GU*/": _RNORM + "            g *= rn;\n            u *= rn;",
    "/*SCALE_AB*/": _RNORM + "            a *= rn;\n            b *= rn;",
}

# mode -> (inputs after x, w, scales, biases; output names, block rows, row map, epilogue)
MODES = {
    "plain": ((), ("y",), _ROWS_CONSECUTIVE, _ROW_MAP_CONSECUTIVE, _EPILOGUE_PLAIN),
    "qkv": ((), ("q_out", "k_out", "v_out"), _ROWS_CONSECUTIVE, _ROW_MAP_CONSECUTIVE, _EPILOGUE_QKV),
    "swiglu": ((), ("y",), _ROWS_GATE_UP, _ROW_MAP_GATE_UP, _EPILOGUE_SWIGLU),
    "residual": (("residual",), ("y",), _ROWS_CONSECUTIVE, _ROW_MAP_CONSECUTIVE, _EPILOGUE_RESIDUAL),
}
NORM_INPUTS = ("norm_w",)
ROPE_INPUTS = ("positions", "inv_freq")
for _base in ("qkv", "swiglu"):
    MODES[f"{_base}_norm"] = (NORM_INPUTS, *MODES[_base][1:])
_QKV_OUT = MODES["qkv"][1]
MODES["qkv_rope"] = (ROPE_INPUTS, _QKV_OUT, _ROWS_PAIRS, _ROW_MAP_PAIRS, _EPILOGUE_QKV_ROPE)
MODES["qkv_norm_rope"] = (NORM_INPUTS + ROPE_INPUTS, _QKV_OUT, _ROWS_PAIRS, _ROW_MAP_PAIRS, _EPILOGUE_QKV_ROPE)


def base_mode(mode: str) -> str:
    """The mode without its "_norm" / "_rope" (the outputs are the base mode's)."""
    return mode.removesuffix("_rope").removesuffix("_norm")


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
