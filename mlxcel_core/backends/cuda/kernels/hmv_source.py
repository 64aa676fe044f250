"""The CUDA text of the 16-bit decode matvec kernel (kernels/hmv.py): its main loop and header helpers. The
reductions, modes and epilogues are the 4-bit kernel's (kernels/qmv_source.py, which assembles both kinds).
"""

from __future__ import annotations

# The main loop for 16-bit weights (bf16/fp16 W [N, K], K a multiple of 8): each lane takes 8-element chunks of K
# (one 16-byte streaming load per weight row, a warp's 32 loads contiguous), UNROLL chunks' loads issued before any is
# used, x read once per chunk for all ROWS rows; float32 multiply-adds.
_MAIN_HALF = r"""
    constexpr int M = CFG & 15;  // rows of x
    constexpr int ROWS = (CFG >> 12) & 15;  // output rows per block
    constexpr int WARPS = (CFG >> 16) & 15;  // warps per block (splitting K)
    constexpr int UNROLL = (CFG >> 20) & 15;  // chunks per lane whose loads are in flight together
/*GROUP_IDS*/
    using W = typename mlxcel_qmv_pointee<decltype(w)>::type;
    using OUT = typename mlxcel_qmv_result<T, W>::type;  // mx.result_type(x, w)
    static_assert(sizeof(W) == 2, "16-bit weights");
    static_assert(mlxcel_qmv_same<OUT, typename mlxcel_qmv_pointee<decltype(/*OUT0*/)>::type>::value,
                  "output dtype must be mx.result_type(x, w)");
    constexpr int CHUNK = 8;  // elements of K per lane per step (16 bytes of a weight row)
    constexpr int STRIDE = WARPS * 32 * CHUNK;  // K covered by one round of the block's lanes
    const int N = w_shape[0];
    const int K = w_shape[1];  // x is M rows of K (any leading shape: only its data is read)
/*ROWS_OF_BLOCK*/

    const bool w_vec = (reinterpret_cast<size_t>(w) & 15) == 0;  // K % 8 == 0: rows are 16-byte multiples apart
    const bool x_vec = (reinterpret_cast<size_t>(x) & 15) == 0;
/*NORM_DECL*/

    const W* w_row[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
/*ROW_MAP*/
        w_row[r] = w + n * size_t(K);
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
        uint4 q[UNROLL][ROWS];  // every load of the UNROLL chunks first, then the arithmetic
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int k = k0 + u * STRIDE;
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                q[u][r] = k < K ? mlxcel_hmv_load_w(w_row[r] + k, w_vec) : make_uint4(0u, 0u, 0u, 0u);
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int k = k0 + u * STRIDE;
            if (k < K) {
                float xv[M][8];
/*NORM_G*/
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    mlxcel_qmv_load_x(x + size_t(m) * K + k, xv[m], x_vec);
/*NORM_X*/
                }
#pragma unroll
                for (int r = 0; r < ROWS; ++r) {
                    float wv[8];
                    mlxcel_hmv_unpack<W>(q[u][r], wv);
#pragma unroll
                    for (int m = 0; m < M; ++m) {
                        float p = acc[r][m];
#pragma unroll
                        for (int j = 0; j < 8; ++j) {
                            p = fmaf(xv[m][j], wv[j], p);
                        }
                        acc[r][m] = p;
                    }
                }
            }
        }
    }
"""

_HEADER_HALF = r"""
// Eight 16-bit weights (16 bytes), streamed: read once, so marked evict-first.
template <typename W>
__device__ __forceinline__ uint4 mlxcel_hmv_load_w(const W* p, bool vec) {
    if (vec) {
        return __ldcs(reinterpret_cast<const uint4*>(p));
    }
    alignas(16) W t[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        t[j] = p[j];
    }
    return *reinterpret_cast<const uint4*>(t);
}

template <typename W>
__device__ __forceinline__ void mlxcel_hmv_unpack(const uint4& v, float* out) {
    const W* t = reinterpret_cast<const W*>(&v);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        out[j] = static_cast<float>(t[j]);
    }
}
"""
