"""The CUDA source text of the paged decode kernels (backends/cuda/paged_attention.py says what they compute and how
they are launched): the split kernel with its variants (`kernel_source`) and the combine kernel; and the runner name
autotune keys its results on, which changes with them. Imports nothing (`mlxcel tune --dry-run` reads the name
without MLX)."""

from __future__ import annotations

import hashlib

from .kernels.pdl_prefetch import paged_with_prefetch
from .paged_attention_mma import HEADER as MMA_HEADER  # noqa: F401  (paged_attention.py's)
from .paged_attention_mma import body as _mma_body
from .paged_attention_tile import TILE_LOOP as _TILE_LOOP

MMA_MAX_GROUP = 8  # query heads a block of the tensor-core body (the columns of its P.V products)


def mma_head_dim(head_dim: int) -> bool:
    """Whether the tensor-core body takes this head dim: a thread's quarter of a row in 16-byte loads, two tiles of it
    in registers (paged_attention_mma.py); with 16-bit q and KV of one type (paged_attention.takes_mma)."""
    return head_dim % 32 == 0 and 32 <= head_dim <= 128


MMA_DTYPES = ("bfloat16", "float16")  # the pools' types the tensor-core body reads (by name: this imports no MLX)


def body_is_mma(dtype: str, head_dim: int) -> bool:
    """Whether a call with q and pools of dtype `dtype` (a name, e.g. "bfloat16") runs the tensor-core body."""
    return dtype in MMA_DTYPES and mma_head_dim(head_dim)


def geometry(head_dim: int, n_rep: int, mma: bool = False) -> dict[str, int]:
    """Lanes per token (LPT), head-dim elements per lane (EPL) and query heads per block (G) of either body
    (paged_attention.launch_geometry checks the head dim first; autotune counts blocks with it)."""
    if mma:  # (a warp's 32 lanes share its tokens; G: the largest divisor of n_rep up to MMA_MAX_GROUP)
        return {"LPT": 32, "EPL": head_dim // 32, "G": max(g for g in range(1, MMA_MAX_GROUP + 1) if n_rep % g == 0)}
    lpt = 1
    while lpt < 32 and lpt * 8 < head_dim:
        lpt *= 2
    epl = -(-head_dim // lpt)
    group = max([g for g in range(1, n_rep + 1) if n_rep % g == 0 and g * epl <= 32] or [1])
    return {"LPT": lpt, "EPL": epl, "G": group}


_PROLOGUE = r"""
    constexpr int NVG = TPB / LPT;  // lane groups per block, one token each per iteration
    constexpr int HQ = HKV * NREP;
    constexpr int GROUPS = NREP / G;
    const int S = gridDim.x;
    const int split = blockIdx.x;
    const int kvh = blockIdx.y / GROUPS;
    const int h0 = kvh * NREP + (blockIdx.y % GROUPS) * G;
    const int b = blockIdx.z;
    const int tid = threadIdx.x;
    const int vg = tid / LPT;
    const int sub = tid % LPT;

    const int max_blocks = block_tables_shape[1];
    int len = context_lens[b];
    len = len < 0 ? 0 : (len > max_blocks * BS ? max_blocks * BS : len);
    // The first visible key: a sliding window's (its last WINDOW positions), a chunked layer's (its own chunk).
    const int lo_window = (WINDOW > 0 && len > WINDOW) ? len - WINDOW : 0;
    const int lo_chunk = (CHUNK > 0 && len > 0) ? (len - 1) / CHUNK * CHUNK : 0;
    const int lo = max(lo_window, lo_chunk);
    const int chunk = (len - lo + S - 1) / S;
    const int t0 = min(len, lo + split * chunk);
    const int t1 = min(len, t0 + chunk);
    const float sc = __int_as_float(SCALE_BITS);  // the softmax scale, a compile-time constant (see _scale_bits)
    const float NEG_INF = __int_as_float(0xff800000);
/*NEW_KV*/

    // The lane groups' (the tensor-core body: the warps') states, merged after the body.
    __shared__ float sm_m[NVG][G];
    __shared__ float sm_l[NVG][G];
    __shared__ float sm_o[NVG][G][D];
"""

# The lane-group body: each lane group of LPT lanes takes one token at a time (the module docstring of
# paged_attention.py); leaves its state in sm_m, sm_l, sm_o at index vg.
_LANE_GROUP_BODY = r"""
    float qv[G][EPL];
    float m[G];
    float l[G];
    float acc[G][EPL];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        m[g] = NEG_INF;
        l[g] = 0.0f;
#pragma unroll
        for (int i = 0; i < EPL; ++i) {
            const int d = sub * EPL + i;
            qv[g][i] = d < D ? static_cast<float>(q[(size_t(b) * HQ + h0 + g) * D + d]) * sc : 0.0f;
            acc[g][i] = 0.0f;
        }
    }

    // 16-byte loads when a lane's slice is a whole number of 16-byte words and the pools are aligned.
    constexpr bool VEC = (LPT * EPL == D) && ((EPL * sizeof(KV)) % 16 == 0);
    const bool aligned = VEC && ((reinterpret_cast<size_t>(k_pool) | reinterpret_cast<size_t>(v_pool) |
                                  reinterpret_cast<size_t>(k_new) | reinterpret_cast<size_t>(v_new)) % 16 == 0);
    const int* table = block_tables + size_t(b) * max_blocks;

    // The lane groups' tiles of tokens into their online softmax (paged_attention_tile.py).
/*TILE_LOOP*/

    // The lane group's state into the block's merge arrays.
#pragma unroll
    for (int g = 0; g < G; ++g) {
        if (sub == 0) {
            sm_m[vg][g] = m[g];
            sm_l[vg][g] = l[g];
        }
#pragma unroll
        for (int i = 0; i < EPL; ++i) {
            const int d = sub * EPL + i;
            if (d < D) {
                sm_o[vg][g][d] = acc[g][i];
            }
        }
    }
"""

# Merge the lane groups' states, then write this split's partials.
_MERGE = r"""
    __syncthreads();
    for (int idx = tid; idx < G * D; idx += TPB) {
        const int g = idx / D;
        const int d = idx % D;
        float mx_ = NEG_INF;
        for (int w = 0; w < NVG; ++w) {
            mx_ = fmaxf(mx_, sm_m[w][g]);
        }
/*MERGE_SINK*/
        float ls = 0.0f;
        float os = 0.0f;
        if (mx_ != NEG_INF) {
            for (int w = 0; w < NVG; ++w) {
                const float a = expf(sm_m[w][g] - mx_);  // 0 for an empty lane group (m = -inf)
                ls += a * sm_l[w][g];
                os += a * sm_o[w][g][d];
            }
        }
/*MERGE_SINK_SUM*/
        const size_t row = (size_t(b) * HQ + h0 + g) * S + split;
        o_part[row * D + d] = os;
        if (d == 0) {
            m_part[row] = mx_;
            l_part[row] = ls;
        }
    }
/*LAST_BLOCK*/
"""
_SOURCE = (_PROLOGUE + _LANE_GROUP_BODY + _MERGE).replace("/*TILE_LOOP*/", _TILE_LOOP)
_MMA_SOURCE = _PROLOGUE + _mma_body() + _MERGE  # (depth 2; the tuned tactics' key)


# One split (the whole context in one block per head group): the combine step's arithmetic for S = 1 (its rescale
# factor exp(m - m) is exactly 1) done here, the output written in q's dtype: one launch a layer instead of two.
_WRITE_PARTIALS = """        const size_t row = (size_t(b) * HQ + h0 + g) * S + split;
        o_part[row * D + d] = os;
        if (d == 0) {
            m_part[row] = mx_;
            l_part[row] = ls;
        }"""
_WRITE_OUTPUT = """        const size_t row = size_t(b) * HQ + h0 + g;
        out[row * D + d] = static_cast<OUT>(ls > 0.0f ? os / ls : 0.0f);"""
assert _WRITE_PARTIALS in _SOURCE

# Without the step's keys and values: every position is read from the pools.
_POOLS_ONLY = """    constexpr bool NEW_KV = false;
    const KV* const k_new = k_pool;  // never read (NEW_KV false); names the pools' alignment check uses
    const KV* const v_new = v_pool;"""
# With them (inputs k_new, v_new [B, HKV, D] in the pools' dtype, slot_blocks, slot_offsets [B]): each row's last
# position is read from k_new / v_new, and one block per (row, kv head) writes them into the pools at the row's slot,
# in place. MLX sees the pools as inputs only; no thread of this launch reads that slot (its position is the fresh
# one), and later launches are ordered after this one (engine/paged.py says how).
_WITH_NEW_KV = """    constexpr bool NEW_KV = true;
    if (split == 0 && blockIdx.y % GROUPS == 0) {
        const int sb = slot_blocks[b];
        const int so = slot_offsets[b];
        if (sb >= 0 && sb < k_pool_shape[0] && so >= 0 && so < BS) {
            const size_t dst = ((size_t(sb) * BS + so) * HKV + kvh) * D;
            const size_t src = (size_t(b) * HKV + kvh) * D;
            for (int d = tid; d < D; d += TPB) {
                const_cast<KV*>(k_pool)[dst + d] = k_new[src + d];
                const_cast<KV*>(v_pool)[dst + d] = v_new[src + d];
            }
        }
    }"""


# Several splits, combined by the last of a head group's blocks to finish (extra input `counters`, int32 zeros, one per
# (row, head group), which MLX sees as an input only): each block writes its partials, makes them visible device-wide
# and counts itself in; the block that counts S sets the counter back to 0 for the next launch and does the combine
# step's arithmetic (the same operations in the same order as _COMBINE_SOURCE, so the same values; the per-split
# weights computed once per head, not per element). One launch a layer
# instead of two. Launches that share counters must not run at the same time: a layer's launches in successive
# decode steps never do (each step needs the previous step's token).
_LAST_BLOCK_COMBINES = r"""    __threadfence();  // this block's partials, visible to whichever block combines
    __syncthreads();
    __shared__ bool combines;
    if (tid == 0) {
        int* counter = const_cast<int*>(counters) + (size_t(b) * gridDim.y + blockIdx.y);
        combines = atomicAdd(counter, 1) == S - 1;
        if (combines) {
            atomicExch(counter, 0);  // every split has arrived
        }
    }
    __syncthreads();
    if (!combines) {
        return;
    }
    __threadfence();
    // The head group's S maxima and sums, loaded by all threads at once into sm_o (free after the merge; the caller
    // keeps 2 G S <= NVG G D), become each split's weight exp(m_s - max m) and the total sum, one thread per head.
    float* const weights = &sm_o[0][0][0];
    for (int i = tid; i < G * S; i += TPB) {
        const size_t at = (size_t(b) * HQ + h0 + i / S) * S + i % S;
        weights[i] = __ldcg(m_part + at);
        weights[G * S + i] = __ldcg(l_part + at);
    }
    __syncthreads();
    __shared__ float sums[G];
    if (tid < G) {
        float mx_ = NEG_INF;
        for (int s = 0; s < S; ++s) {
            mx_ = fmaxf(mx_, weights[tid * S + s]);
        }
/*COMBINE_SINK*/
        float ls = 0.0f;
        for (int s = 0; s < S; ++s) {
            const float a = mx_ != NEG_INF ? expf(weights[tid * S + s] - mx_) : 0.0f;  // 0 for an empty split
            ls += a * weights[G * S + tid * S + s];
            weights[tid * S + s] = a;
        }
/*COMBINE_SINK_SUM*/
        sums[tid] = ls;
    }
    __syncthreads();
    // Each thread sums VW consecutive elements of one head over the splits (16-byte loads where D allows), 8 splits'
    // loads in flight: the S partials are read in a few rounds of L2 latency, not one round per split.
    constexpr int VW = D % 4 == 0 ? 4 : 1;
    const bool vec = VW == 4 && reinterpret_cast<size_t>(o_part) % 16 == 0;
    for (int idx = tid; idx < G * (D / VW); idx += TPB) {
        const int g = idx / (D / VW);
        const int d = (idx % (D / VW)) * VW;
        const size_t row = size_t(b) * HQ + h0 + g;
        const float* o = o_part + row * S * D + d;
        float os[VW];
#pragma unroll
        for (int k = 0; k < VW; ++k) {
            os[k] = 0.0f;
        }
#pragma unroll 8
        for (int s = 0; s < S; ++s) {
            const float a = weights[g * S + s];
            if (vec) {
                const float4 v = __ldcg(reinterpret_cast<const float4*>(o + size_t(s) * D));
                os[0] += a * v.x;
                os[1] += a * v.y;
                os[2] += a * v.z;
                os[3] += a * v.w;
            } else {
#pragma unroll
                for (int k = 0; k < VW; ++k) {
                    os[k] += a * __ldcg(o + size_t(s) * D + k);
                }
            }
        }
        const float ls = sums[g];
#pragma unroll
        for (int k = 0; k < VW; ++k) {
            out[row * D + d + k] = static_cast<OUT>(ls > 0.0f ? os[k] / ls : 0.0f);
        }
    }"""


# Attention sinks (gpt-oss; extra input `sinks` [HQ], in the model's dtype): a logit per query head that joins the
# softmax's maximum and denominator where the output is normalized, and nothing else (the ops path merges it as one
# more split holding only that logit). A split's partials leave it out; it joins once, in the step writing the output.
_SINK_MAX = """        const float sink = static_cast<float>(sinks[SINK_HEAD]);
        mx_ = fmaxf(mx_, sink);"""
_SINK_SUM = """        ls += expf(sink - mx_);"""
_SINK_HEADS = {"MERGE": "h0 + g", "COMBINE": "h0 + tid", "TWO_LAUNCH": "row % m_part_shape[1]"}


def _with_sinks(source: str, where: str, sinks: bool) -> str:
    """`source` with its `where` placeholders filled: the sink's terms (`sinks`), or nothing."""
    maximum = _SINK_MAX.replace("SINK_HEAD", _SINK_HEADS[where]) if sinks else ""
    source = source.replace(f"/*{where}_SINK*/", maximum)
    return source.replace(f"/*{where}_SINK_SUM*/", _SINK_SUM if sinks else "")


def kernel_source(
    one_split: bool = False,
    new_kv: bool = False,
    last_block_combines: bool = False,
    sinks: bool = False,
    mma: bool = False,
    early: bool = False,
    depth: int = 2,
) -> str:
    """The split kernel's source (partials; with `last_block_combines` also the output, `_LAST_BLOCK_COMBINES`), or
    with one split the output itself; with or without the step's keys and values (`_WITH_NEW_KV`); with `sinks`, the
    output's normalization takes each head's sink (a split's partials never do); with `mma`, the tensor-core body
    (paged_attention_mma.py, compiled with its MMA_HEADER) in place of the lane groups'; with `early`, the prefetch
    of the experiment MLXCEL_PDL_PREFETCH (kernels/pdl_prefetch.py, compiled with its PREFETCH_HELPER); `depth`, the
    tensor-core body's tiles in registers (the experiment MLXCEL_PAGED_MMA_DEPTH)."""
    if one_split and last_block_combines:
        raise ValueError("one split writes the output itself: there is nothing to combine")
    source = _PROLOGUE + _mma_body(depth) + _MERGE if mma else _SOURCE
    source = paged_with_prefetch(source) if early else source
    source = source.replace(_WRITE_PARTIALS, _WRITE_OUTPUT) if one_split else source
    source = _with_sinks(source, "MERGE", sinks and one_split)
    block = _with_sinks(_LAST_BLOCK_COMBINES, "COMBINE", sinks) if last_block_combines else ""
    source = source.replace("/*LAST_BLOCK*/", block)
    return source.replace("/*NEW_KV*/", _WITH_NEW_KV if new_kv else _POOLS_ONLY)


def combine_source(sinks: bool = False) -> str:
    """The two-launch form's combine kernel (`_COMBINE_SOURCE`), with or without the heads' sinks."""
    return _with_sinks(_COMBINE_SOURCE, "TWO_LAUNCH", sinks)


# The combine step: one thread per (row, query head, d) merges the S partials of its column, the same
# log-sum-exp rescaling as `combine_partials` (one launch instead of a handful of MLX ops).
_COMBINE_SOURCE = r"""
    const float NEG_INF = __int_as_float(0xff800000);
    const int S = m_part_shape[2];
    const size_t rows = size_t(m_part_shape[0]) * m_part_shape[1];
    const size_t idx = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= rows * D) {
        return;
    }
    const size_t row = idx / D;
    const int d = idx % D;
    const float* m = m_part + row * S;
    const float* l = l_part + row * S;
    float mx_ = NEG_INF;
    for (int s = 0; s < S; ++s) {
        mx_ = fmaxf(mx_, m[s]);
    }
/*TWO_LAUNCH_SINK*/
    float ls = 0.0f;
    float os = 0.0f;
    if (mx_ != NEG_INF) {
        for (int s = 0; s < S; ++s) {
            const float a = expf(m[s] - mx_);  // 0 for an empty split
            ls += a * l[s];
            os += a * o_part[(row * S + s) * D + d];
        }
    }
/*TWO_LAUNCH_SINK_SUM*/
    out[idx] = static_cast<OUT>(ls > 0.0f ? os / ls : 0.0f);
"""


THREADS = 128  # threads per block
UNROLL = 2  # tokens in flight per lane group (loads issued together)

# Part of the cache key of tuned tactics: a changed kernel must not reuse old measurements.
KERNEL_HASH = hashlib.sha256(
    f"{_SOURCE}{_MMA_SOURCE}{MMA_HEADER}{_COMBINE_SOURCE}{_WRITE_OUTPUT}{_POOLS_ONLY}{_WITH_NEW_KV}{_LAST_BLOCK_COMBINES}{_SINK_MAX}{_SINK_SUM}"
    f"{THREADS}/{UNROLL}".encode()
).hexdigest()[:8]
RUNNER_CUDA = f"cuda-kernel-{KERNEL_HASH}"
