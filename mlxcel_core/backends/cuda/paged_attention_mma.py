"""The CUDA text of the paged decode kernel's tensor-core body, which paged_attention_source.py puts in its kernel in
place of the lane-group body where the query and the pools share a 16-bit type and the head dim is a multiple of 32
up to 128 (backends/cuda/paged_attention.py chooses). Imports nothing.

Why: the lane-group body spends about 65 warp instructions a token (a count of its source) on float32 multiply-adds,
conversions and shuffle reductions, and at long contexts it stays far below the memory's bandwidth. Here a warp takes
8 tokens a tile with the tensor cores (``mma.sync``, float32 accumulation): about 11 instructions a token by the same
count (benchmarks/RESULTS.md has the two bodies timed).

A warp's tile: thread (r = lane / 4, c = lane % 4) loads token r's key and value slices of D / 4 elements (dims
c D / 4 ..), 16-byte loads, as 32-bit pairs.
- Scores S [heads x tokens] = Q K^T: ``m16n8k16`` products, D / 16 of them, Q the A operand (rows: the G query heads
  of the block, zeros past them), K^T the B operand. Step s takes from each thread the four dims c D / 4 + 4 s .. + 3
  as the logical k indices 2c, 2c + 1, 2c + 8, 2c + 9 of both operands (the same permutation on both, so the products
  pair up), so each thread's loaded words are its fragments as they are. Thread (r, c) gets head r's scores of
  tokens 2c and 2c + 1.
- The online softmax runs on those: a tile's maximum over 4 lanes (two shuffles), one rescale, two exponentials a
  thread; each thread keeps its part of the head's sum (added up over the 4 lanes at the end).
- O^T [dims x heads] += V^T P^T: ``m16n8k8`` products, D / 16 of them, twice, P^T the B operand as the scores left it
  (thread (r, c): head r, tokens 2c, 2c + 1) in two 16-bit terms, P = hi + lo (hi: P rounded to the pools' type; lo:
  the rest, rounded): P.V then holds P to about 2^-16 relative in bfloat16 (2^-22 in float16, whose P below 6e-5 keeps
  subnormal, absolute precision), not the 2^-8 of a bfloat16 P as flash attention rounds it, so the output is within
  float32-level rounding of the lane groups' (the sums l take P exactly); the tensor cores have room for it. V^T the A
  operand: each loaded word of V (token r, two adjacent dims) transposed across the warp with ``movmatrix`` gives
  thread (r, c) the values of tokens 2c and 2c + 1 at one dim. Word 2i gives the A rows 0..7 of product i, word 2i + 1
  rows 8..15: row r of product i is dim (r / 2) D / 4 + 4 i + r % 2, row r + 8 the same + 2. Thread (r, c) accumulates
  heads 2c and 2c + 1 at those two dims (four floats a product).
- Registers: two tiles' keys and values (the next tile's loads in flight while this one is taken; 3 or 4 with the
  experiment MLXCEL_PAGED_MMA_DEPTH), D / 4 accumulators,
  D / 8 words of Q.
The warps' (max, sum, output) states go to the block's shared memory as the lane groups' do, and the merge after is
the same.
"""

from __future__ import annotations

from .kernels.qmm_source import MMA_M16N8K16
from .kernels.qmv_source import SAME_TYPE

# The 16-bit type test and the m16n8k16 product are the 4-bit batch kernel's (kernels/qmv_source.py, qmm_source.py).
HEADER = (
    SAME_TYPE
    + MMA_M16N8K16
    + r"""
// Two floats as a pair of KV (lo in the low half: the fragment element of the lower index).
template <typename KV>
__device__ __forceinline__ uint32_t mlxcel_pa_pack(float lo, float hi) {
    if constexpr (mlxcel_qmv_same<KV, __half>::value) {
        __half2 h = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&h);
    } else {
        __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&h);
    }
}

// The two KV values packed in v, as floats (exactly).
template <typename KV>
__device__ __forceinline__ float2 mlxcel_pa_unpack(uint32_t v) {
    if constexpr (mlxcel_qmv_same<KV, __half>::value) {
        return make_float2(__half2float(__ushort_as_half(static_cast<unsigned short>(v & 0xFFFFu))),
                           __half2float(__ushort_as_half(static_cast<unsigned short>(v >> 16))));
    } else {
        return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xFFFF0000u));
    }
}

// The warp's 8 x 8 matrix of 16-bit values (thread (r, c) holds row r, columns 2c, 2c + 1), transposed.
__device__ __forceinline__ uint32_t mlxcel_pa_trans(uint32_t x) {
    uint32_t y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}

// d += a (16 x 8, row) * b (8 x 8, col), float32 accumulators.
template <typename KV>
__device__ __forceinline__ void mlxcel_pa_mma8(float* d, const uint32_t* a, uint32_t b) {
    if constexpr (mlxcel_qmv_same<KV, __half>::value) {
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(b));
    } else {
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(b));
    }
}
"""
)

# The body: after the prologue (indices, the split's tokens t0..t1, `sc`, NEG_INF, the NEW_KV constants) and the
# block's shared merge arrays; leaves each warp's state in sm_m, sm_l, sm_o at index vg (the warp: LPT is 32).
_TAKE = r"""
    static_assert(LPT == 32 && TPB % 32 == 0 && D % 32 == 0 && D <= 128 && G <= 8,
                  "the tensor-core body takes whole warps, head dims 32..128 in steps of 32, up to 8 heads a block");
    constexpr int DPT = D / 4;  // dims of a token a thread loads
    constexpr int RPT = DPT / 2;  // their 32-bit words
    constexpr int KS = D / 16;  // q.k's k-steps (16 dims each), and P.V's products (16 dims each)
    constexpr int STEP = NVG * 8;  // tokens a block's tile (8 a warp)
    const unsigned FULL = 0xffffffffu;
    const int lr = sub >> 2;  // fragment row: this thread's token of a tile, and its head in the scores
    const int lc = sub & 3;  // fragment column pair
    const bool aligned = ((reinterpret_cast<size_t>(k_pool) | reinterpret_cast<size_t>(v_pool) |
                           reinterpret_cast<size_t>(k_new) | reinterpret_cast<size_t>(v_new)) % 16) == 0;
    const int* table = block_tables + size_t(b) * max_blocks;

    uint32_t qa[KS][2];  // head lr's query, dims lc D / 4 + 4 s .. + 3 for step s (zeros past the block's G heads)
#pragma unroll
    for (int s = 0; s < KS; ++s) {
        if (lr < G) {
            const KV* qp = reinterpret_cast<const KV*>(q) + (size_t(b) * HQ + h0 + lr) * D + lc * DPT + 4 * s;
            qa[s][0] = mlxcel_pa_pack<KV>(static_cast<float>(qp[0]), static_cast<float>(qp[1]));
            qa[s][1] = mlxcel_pa_pack<KV>(static_cast<float>(qp[2]), static_cast<float>(qp[3]));
        } else {
            qa[s][0] = qa[s][1] = 0u;
        }
    }
    float m = NEG_INF;  // head lr's running maximum (the same in its 4 lanes)
    float l = 0.0f;  // this thread's part of head lr's running sum
    float o[KS][4];  // heads 2 lc, 2 lc + 1 at two dims a product (the module docstring)
#pragma unroll
    for (int i = 0; i < KS; ++i) {
        o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    }

    // Token base + lr's key and value words (zeros past the split's end).
    auto load = [&](uint32_t (&kr)[RPT], uint32_t (&vr)[RPT], int base) {
        const int tok = base + lr;
        if (tok < t1) {
            const bool fresh = NEW_KV && tok == len - 1;  // (the step's own token: k_new / v_new)
            const size_t off = fresh ? (size_t(b) * HKV + kvh) * D + lc * DPT
                                     : ((size_t(table[tok / BS]) * BS + (tok % BS)) * HKV + kvh) * D + lc * DPT;
            const KV* kp = (fresh ? k_new : k_pool) + off;
            const KV* vp = (fresh ? v_new : v_pool) + off;
            if (aligned) {
#pragma unroll
                for (int j = 0; j < RPT / 4; ++j) {
                    reinterpret_cast<uint4*>(kr)[j] = reinterpret_cast<const uint4*>(kp)[j];
                    reinterpret_cast<uint4*>(vr)[j] = reinterpret_cast<const uint4*>(vp)[j];
                }
            } else {
                const unsigned short* k16 = reinterpret_cast<const unsigned short*>(kp);
                const unsigned short* v16 = reinterpret_cast<const unsigned short*>(vp);
#pragma unroll
                for (int j = 0; j < RPT; ++j) {
                    kr[j] = uint32_t(k16[2 * j]) | (uint32_t(k16[2 * j + 1]) << 16);
                    vr[j] = uint32_t(v16[2 * j]) | (uint32_t(v16[2 * j + 1]) << 16);
                }
            }
        } else {
#pragma unroll
            for (int j = 0; j < RPT; ++j) {
                kr[j] = vr[j] = 0u;
            }
        }
    };
    // One tile of 8 tokens from `base` into the warp's online softmax.
    auto take = [&](const uint32_t (&kr)[RPT], const uint32_t (&vr)[RPT], int base) {
        float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int s = 0; s < KS; ++s) {
            const uint32_t a[4] = {qa[s][0], 0u, qa[s][1], 0u};
            const uint32_t kb[2] = {kr[2 * s], kr[2 * s + 1]};
            mlxcel_qmm_mma<KV>(c, a, kb);
        }
        const int ta = base + 2 * lc;  // c[0], c[1]: head lr's scores of tokens ta, ta + 1
        const bool v0 = ta < t1;
        const bool v1 = ta + 1 < t1;
        float s0 = c[0] * sc;
        float s1 = c[1] * sc;
        if (SOFTCAP_BITS != 0) {  // Gemma 2's soft-capping: s = tanh(s / cap) * cap
            const float cap = __int_as_float(SOFTCAP_BITS);
            s0 = tanhf(s0 / cap) * cap;
            s1 = tanhf(s1 / cap) * cap;
        }
        float mt = fmaxf(v0 ? s0 : NEG_INF, v1 ? s1 : NEG_INF);
        mt = fmaxf(mt, __shfl_xor_sync(FULL, mt, 1));
        mt = fmaxf(mt, __shfl_xor_sync(FULL, mt, 2));
        const float mn = fmaxf(m, mt);
        const float corr = mn == NEG_INF ? 1.0f : expf(m - mn);  // 0 while m is still -inf; 1 with nothing seen yet
        const float p0 = v0 ? expf(s0 - mn) : 0.0f;
        const float p1 = v1 ? expf(s1 - mn) : 0.0f;
        l = l * corr + p0 + p1;
        m = mn;
        const float ca = __shfl_sync(FULL, corr, 8 * lc);  // heads 2 lc and 2 lc + 1's factors, from their lanes
        const float cb = __shfl_sync(FULL, corr, 8 * lc + 4);
        // P as two 16-bit terms, hi + lo, each its own product: P.V with P to about 16 bits (bf16), not 8 (or 11)
        const uint32_t ph = mlxcel_pa_pack<KV>(p0, p1);
        const float2 hf = mlxcel_pa_unpack<KV>(ph);
        const uint32_t pl = mlxcel_pa_pack<KV>(p0 - hf.x, p1 - hf.y);
#pragma unroll
        for (int i = 0; i < KS; ++i) {
            const uint32_t va[2] = {mlxcel_pa_trans(vr[2 * i]), mlxcel_pa_trans(vr[2 * i + 1])};
            o[i][0] *= ca;
            o[i][1] *= cb;
            o[i][2] *= ca;
            o[i][3] *= cb;
            mlxcel_pa_mma8<KV>(o[i], va, ph);
            mlxcel_pa_mma8<KV>(o[i], va, pl);
        }
    };
"""

_REGISTER_LOOP = r"""
    alignas(16) uint32_t ka[RPT], va[RPT], kb[RPT], vb[RPT];
    const int first = t0 + vg * 8;
    load(ka, va, first);
    for (int base = first; base < t1; base += 2 * STEP) {  // the same trip count for every thread of a warp
        load(kb, vb, base + STEP);
        take(ka, va, base);
        load(ka, va, base + 2 * STEP);
        take(kb, vb, base + STEP);
    }

"""


def _register_loop(depth: int) -> str:
    """The token loop keeping `depth` tiles of keys and values in registers: `depth - 1` tiles' loads in flight while
    one is taken (2: `_REGISTER_LOOP`). The tiles are taken in the same order at every depth, so the results are the
    same bit for bit."""
    if depth == 2:
        return _REGISTER_LOOP
    if not 2 <= depth <= 4:
        raise ValueError(f"the tensor-core body keeps 2 to 4 tiles in registers, got {depth}")
    buffers = ", ".join(f"k{i}[RPT], v{i}[RPT]" for i in range(depth))
    lines = [f"    alignas(16) uint32_t {buffers};", "    const int first = t0 + vg * 8;"]
    lines += [f"    load(k{i}, v{i}, first + {i} * STEP);" for i in range(depth - 1)]
    lines.append(f"    for (int base = first; base < t1; base += {depth} * STEP) {{  // (one trip count a warp)")
    for i in range(depth):
        ahead = (i + depth - 1) % depth
        lines.append(f"        load(k{ahead}, v{ahead}, base + {i + depth - 1} * STEP);")
        lines.append(f"        take(k{i}, v{i}, base + {i} * STEP);")
    lines.append("    }")
    return "\n" + "\n".join(lines) + "\n\n"


_TAIL = r"""
    // The warp's state into the block's merge arrays.
    l += __shfl_xor_sync(FULL, l, 1);
    l += __shfl_xor_sync(FULL, l, 2);
    if (lc == 0 && lr < G) {
        sm_m[vg][lr] = m;
        sm_l[vg][lr] = l;
    }
#pragma unroll
    for (int i = 0; i < KS; ++i) {
        const int d = (lr >> 1) * DPT + 4 * i + (lr & 1);
        if (2 * lc < G) {
            sm_o[vg][2 * lc][d] = o[i][0];
            sm_o[vg][2 * lc][d + 2] = o[i][2];
        }
        if (2 * lc + 1 < G) {
            sm_o[vg][2 * lc + 1][d] = o[i][1];
            sm_o[vg][2 * lc + 1][d + 2] = o[i][3];
        }
    }
"""


def body(depth: int = 2) -> str:
    """The tensor-core body with `depth` tiles in registers (the experiment MLXCEL_PAGED_MMA_DEPTH; 2: `BODY`)."""
    return _TAKE + _register_loop(depth) + _TAIL


BODY = body()
