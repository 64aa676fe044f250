"""The decode matvec kernels' modes (kernels/qmv_source.py assembles them into a kernel): each mode's block rows, row
map and epilogue, and the RMSNorm taken into a launch ("_norm" modes)."""

from __future__ import annotations

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


def _pair_epilogue(index: str, limit: str, first: str, second: str, scale: str, write: str) -> str:
    """An epilogue over output pairs: pair `index` < `limit` of the block sums weight rows r and r + HALF into
    `first` and `second`, takes the folded norm's `scale` placeholder, rounds both to OUT (as separate matvecs
    return them), then runs `write`."""
    return f"""    for (int i = gtid; i < HALF * M; i += WARPS * 32) {{
        const int r = i / M;
        const int m = i % M;
        const int {index} = n0 + r;
        if ({index} < {limit}) {{
            float {first} = 0.0f;
            float {second} = 0.0f;
#pragma unroll
            for (int v = 0; v < WARPS; ++v) {{
                {first} += red[v][r * M + m];
                {second} += red[v][(r + HALF) * M + m];
            }}
/*{scale}*/
            {first} = static_cast<float>(static_cast<OUT>({first}));
            {second} = static_cast<float>(static_cast<OUT>({second}));
{write}
        }}
    }}"""


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
_EPILOGUE_QKV_ROPE = _pair_epilogue(
    "p",
    "NPAIR",
    "a",
    "b",
    "SCALE_AB",
    """            const int j = p % (HD / 2);
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
            mlxcel_qmv_store_qkv(q_out, k_out, v_out, NQ, NK, m, n + HD / 2, static_cast<OUT>(ob));""",
)

# y [M, N] = residual + x @ w.T: the product rounded to OUT first, as the separate matvec returns it, then the add
# in float32 and one rounding to OUT, as a separate add computes it.
_EPILOGUE_RESIDUAL = _EPILOGUE_ROWS.replace(
    "/*WRITE*/",
    """            const size_t o = size_t(m) * N + n;
            y[o] = static_cast<OUT>(static_cast<float>(static_cast<OUT>(t)) + static_cast<float>(residual[o]));""",
)

# y [M, NOUT] = silu(gate) * up. gate and up are first rounded to OUT, as two separate matvecs would return them,
# then silu(g) * u = g * sigmoid(g) * u in float32 and one rounding (the unfused path rounds after every op).
_EPILOGUE_SWIGLU = _pair_epilogue(
    "j",
    "NOUT",
    "g",
    "u",
    "SCALE_GU",
    "            y[size_t(m) * NOUT + j] = static_cast<OUT>(g / (1.0f + expf(-g)) * u);",
)

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
