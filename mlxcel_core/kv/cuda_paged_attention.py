"""Paged decode attention as one CUDA kernel with a split-K launch parameter (``mx.fast.cuda_kernel``).

Same contract and results as ``paged_attention.paged_decode_attention`` (the MLX-ops path, which runs
on every backend and stays the fallback): q [B, Hq, D] or [B, Hq, 1, D], pools [num_blocks, block_size, Hkv,
D], block_tables int [B, max_blocks], context_lens int [B]; returns q's shape and dtype, zeros for a row whose
context is empty.

Kernel ("paged_decode_split"): one thread block per (split, kv head x query-head group, row). A row's
context is cut into ``num_splits`` contiguous chunks of ceil(len / num_splits) tokens; the block of split
s walks its chunk straight through the block table (no gather): NVG lane groups of LPT lanes, each
group with UNROLL tokens' loads in flight, each lane holding EPL elements of the head dim. Every lane
group keeps an online softmax (running max m, sum l, weighted V) in float32 for the G query heads that
share the kv head,
so K and V are read once per kv head, not once per query head. The groups' states are merged in shared
memory and the block writes its split's partial max [B, Hq, S], sum [B, Hq, S] and unnormalized
output [B, Hq, S, D] (float32). The combine step ("paged_decode_combine", a second small kernel; the same
arithmetic as `combine_partials` in MLX ops) rescales the partials by exp(m_s - max m) and divides,
exactly as the ops path merges its splits, writing q's dtype. With one split the kernel writes the output itself
("paged_decode_one_split", the combine's arithmetic for S = 1 in the same launch): one launch a layer.

``num_splits`` is the grid's x extent: every value is the same compiled kernel. The kernel is compiled
once per (dtypes, D, block_size, Hkv, n_rep) at first use (NVRTC).

Validated on the device by tests/mlxcel_core/kv/test_cuda_paged_attention.py (skipped without CUDA).
No Metal kernel exists: on Apple silicon, as on CPU, the ops path runs.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os

import mlx.core as mx

from ..cuda_small_arrays import float32_bits
from .paged_attention import check_decode_arguments

RUNNER_OPS = "mlx-ops"
THREADS = 128  # threads per block
UNROLL = 2  # tokens in flight per lane group (loads issued together)
MAX_HEAD_DIM = 1024

_SOURCE = r"""
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
    const int chunk = (len + S - 1) / S;
    const int t0 = min(len, split * chunk);
    const int t1 = min(len, t0 + chunk);
    const float sc = __int_as_float(SCALE_BITS);  // the softmax scale, a compile-time constant (see _scale_bits)
    const float NEG_INF = __int_as_float(0xff800000);
/*NEW_KV*/

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

    // UNROLL tokens per lane group per iteration: all their loads are issued before any of them is used.
    for (int base = t0; base < t1; base += NVG * UNROLL) {  // the same trip count for every thread of the block
        float kf[UNROLL][EPL];
        float vf[UNROLL][EPL];
        bool valid[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int t = base + u * NVG + vg;
            valid[u] = t < t1;
            if (valid[u]) {
                // The step's own token (NEW_KV: the last position) comes from k_new / v_new, not the pools.
                const bool fresh = NEW_KV && t == len - 1;
                const size_t off = fresh ? (size_t(b) * HKV + kvh) * D + sub * EPL
                                         : ((size_t(table[t / BS]) * BS + (t % BS)) * HKV + kvh) * D + sub * EPL;
                const KV* kp = (fresh ? k_new : k_pool) + off;
                const KV* vp = (fresh ? v_new : v_pool) + off;
                if (aligned) {
                    alignas(16) KV kt[EPL];
                    alignas(16) KV vt[EPL];
#pragma unroll
                    for (int j = 0; j < int(EPL * sizeof(KV) / 16); ++j) {
                        reinterpret_cast<uint4*>(kt)[j] = reinterpret_cast<const uint4*>(kp)[j];
                        reinterpret_cast<uint4*>(vt)[j] = reinterpret_cast<const uint4*>(vp)[j];
                    }
#pragma unroll
                    for (int i = 0; i < EPL; ++i) {
                        kf[u][i] = static_cast<float>(kt[i]);
                        vf[u][i] = static_cast<float>(vt[i]);
                    }
                } else {
#pragma unroll
                    for (int i = 0; i < EPL; ++i) {
                        const bool in = sub * EPL + i < D;
                        kf[u][i] = in ? static_cast<float>(kp[i]) : 0.0f;
                        vf[u][i] = in ? static_cast<float>(vp[i]) : 0.0f;
                    }
                }
            } else {
#pragma unroll
                for (int i = 0; i < EPL; ++i) {
                    kf[u][i] = 0.0f;
                    vf[u][i] = 0.0f;
                }
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
            for (int g = 0; g < G; ++g) {
                float s = 0.0f;
#pragma unroll
                for (int i = 0; i < EPL; ++i) {
                    s += qv[g][i] * kf[u][i];
                }
#pragma unroll
                for (int o = LPT / 2; o > 0; o >>= 1) {
                    s += __shfl_xor_sync(0xffffffffu, s, o);
                }
                if (valid[u]) {
                    const float m_new = fmaxf(m[g], s);
                    const float corr = expf(m[g] - m_new);  // 0 while m is still -inf
                    const float p = expf(s - m_new);
                    l[g] = l[g] * corr + p;
#pragma unroll
                    for (int i = 0; i < EPL; ++i) {
                        acc[g][i] = acc[g][i] * corr + p * vf[u][i];
                    }
                    m[g] = m_new;
                }
            }
        }
    }

    // Merge the lane groups' states, then write this split's partials.
    __shared__ float sm_m[NVG][G];
    __shared__ float sm_l[NVG][G];
    __shared__ float sm_o[NVG][G][D];
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
    __syncthreads();
    for (int idx = tid; idx < G * D; idx += TPB) {
        const int g = idx / D;
        const int d = idx % D;
        float mx_ = NEG_INF;
        for (int w = 0; w < NVG; ++w) {
            mx_ = fmaxf(mx_, sm_m[w][g]);
        }
        float ls = 0.0f;
        float os = 0.0f;
        if (mx_ != NEG_INF) {
            for (int w = 0; w < NVG; ++w) {
                const float a = expf(sm_m[w][g] - mx_);  // 0 for an empty lane group (m = -inf)
                ls += a * sm_l[w][g];
                os += a * sm_o[w][g][d];
            }
        }
        const size_t row = (size_t(b) * HQ + h0 + g) * S + split;
        o_part[row * D + d] = os;
        if (d == 0) {
            m_part[row] = mx_;
            l_part[row] = ls;
        }
    }
"""

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


def kernel_source(one_split: bool = False, new_kv: bool = False) -> str:
    """The split kernel's source (partials), or with one split the output itself; with or without the step's keys
    and values (`_WITH_NEW_KV`)."""
    source = _SOURCE.replace(_WRITE_PARTIALS, _WRITE_OUTPUT) if one_split else _SOURCE
    return source.replace("/*NEW_KV*/", _WITH_NEW_KV if new_kv else _POOLS_ONLY)


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
    float ls = 0.0f;
    float os = 0.0f;
    if (mx_ != NEG_INF) {
        for (int s = 0; s < S; ++s) {
            const float a = expf(m[s] - mx_);  // 0 for an empty split
            ls += a * l[s];
            os += a * o_part[(row * S + s) * D + d];
        }
    }
    out[idx] = static_cast<OUT>(ls > 0.0f ? os / ls : 0.0f);
"""

# Part of the cache key of tuned tactics: a changed kernel must not reuse old measurements.
KERNEL_HASH = hashlib.sha256(
    f"{_SOURCE}{_COMBINE_SOURCE}{_WRITE_OUTPUT}{_POOLS_ONLY}{_WITH_NEW_KV}{THREADS}/{UNROLL}".encode()).hexdigest()[:8]
RUNNER_CUDA = f"cuda-kernel-{KERNEL_HASH}"


def launch_geometry(head_dim: int, n_rep: int) -> dict[str, int]:
    """Lanes per token (LPT), head-dim elements per lane (EPL) and query heads per block (G).

    LPT is the smallest power of two (<= 32) giving each lane at most 8 elements; G is the largest
    divisor of n_rep with G x EPL <= 32 registers of query and of accumulator per lane."""
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"the CUDA paged-decode kernel supports head_dim 1..{MAX_HEAD_DIM}, got {head_dim}")
    lpt = 1
    while lpt < 32 and lpt * 8 < head_dim:
        lpt *= 2
    epl = -(-head_dim // lpt)
    group = max([g for g in range(1, n_rep + 1) if n_rep % g == 0 and g * epl <= 32] or [1])
    return {"LPT": lpt, "EPL": epl, "G": group}


@functools.cache
def cuda_kernel_available() -> bool:
    """True when MLX has a CUDA backend with a usable device (the kernel can be JIT-compiled)."""
    try:
        return bool(getattr(mx, "cuda", None) and mx.cuda.is_available() and hasattr(mx.fast, "cuda_kernel"))
    except Exception:
        return False


KV_WRITE_ENV = "MLXCEL_KV_IN_KERNEL"  # "0": a decode step's keys and values go to the pools by scatter ops


def kv_written_in_kernel() -> bool:
    """Whether decode steps on the kernel have it write their keys and values (`new_kv`), as by default; with
    MLXCEL_KV_IN_KERNEL=0 they are scattered into the pools first (two MLX ops a layer) and the kernel only reads."""
    return os.environ.get(KV_WRITE_ENV, "").strip() != "0"


def describe_kv_writes() -> str:
    """For benchmark headers: how paged decode steps put their keys and values into the pools here."""
    if not cuda_kernel_available():
        return "paged KV written by scatter ops (MLXCEL_KV_IN_KERNEL applies on CUDA only)"
    if kv_written_in_kernel():
        return "paged KV written by the attention kernel (MLXCEL_KV_IN_KERNEL)"
    return "paged KV written by scatter ops (MLXCEL_KV_IN_KERNEL=0)"


def runner_for(head_dim: int) -> str:
    """Which implementation decode attention runs on here: the CUDA kernel or the MLX-ops path."""
    return RUNNER_CUDA if cuda_kernel_available() and head_dim <= MAX_HEAD_DIM else RUNNER_OPS


INPUTS = ("q", "k_pool", "v_pool", "block_tables", "context_lens")
NEW_KV_INPUTS = ("k_new", "v_new", "slot_blocks", "slot_offsets")


@functools.cache
def _kernel(one_split: bool = False, new_kv: bool = False):
    return mx.fast.cuda_kernel(
        name=f"paged_decode_{'one_split' if one_split else 'split'}{'_new_kv' if new_kv else ''}",
        input_names=[*INPUTS, *(NEW_KV_INPUTS if new_kv else ())],
        output_names=["out"] if one_split else ["o_part", "m_part", "l_part"],
        source=kernel_source(one_split, new_kv),
    )


@functools.cache
def _combine_kernel():
    return mx.fast.cuda_kernel(
        name="paged_decode_combine",
        input_names=["o_part", "m_part", "l_part"],
        output_names=["out"],
        source=_COMBINE_SOURCE,
    )


def _scale_bits(scale: float) -> int:
    """The float32 bits of a positive, finite softmax scale, as the kernel's SCALE_BITS template constant, not an
    input array (cuda_small_arrays.py says why)."""
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"the CUDA paged-decode kernel needs a positive, finite scale, got {scale!r}")
    return float32_bits(scale)


def combine_partials(o_part: mx.array, m_part: mx.array, l_part: mx.array) -> mx.array:
    """Merge per-split partials (o [..., S, D] unnormalized, m and l [..., S]) into [..., D] float32."""
    M = m_part.max(axis=-1, keepdims=True)
    empty = m_part == -mx.inf
    alpha = mx.where(empty, 0.0, mx.exp(m_part - mx.where(M == -mx.inf, 0.0, M)))
    L = (alpha * l_part).sum(axis=-1)[..., None]
    O = (alpha[..., None] * o_part).sum(axis=-2)
    return mx.where(L > 0, O / mx.where(L > 0, L, 1.0), 0.0)


def _new_kv_inputs(new_kv, k_pool, B: int) -> list[mx.array]:
    """(k, v [B, Hkv, D], slot_blocks, slot_offsets [B]) checked, as the kernel's extra inputs."""
    k, v, blocks, offsets = new_kv
    want = (B, *k_pool.shape[2:])
    if k.shape != want or v.shape != want:
        raise ValueError(f"the step's keys and values must be {want}, got {k.shape} and {v.shape}")
    if blocks.shape != (B,) or offsets.shape != (B,):
        raise ValueError(f"slot blocks and offsets must be [{B}], got {blocks.shape} and {offsets.shape}")
    return [k.astype(k_pool.dtype), v.astype(k_pool.dtype), blocks.astype(mx.int32), offsets.astype(mx.int32)]


def cuda_paged_decode_attention(q, k_pool, v_pool, block_tables, context_lens, num_splits: int = 1,
                                scale: float | None = None, new_kv: tuple | None = None,
                                _two_launches: bool = False) -> mx.array:
    """``paged_decode_attention`` on the CUDA kernel (needs the CUDA backend; see the module docstring). One split
    is one launch (the split kernel writes the output itself); `_two_launches` (tests) runs it as split + combine.

    new_kv = (k, v [B, Hkv, D], slot_blocks, slot_offsets [B]): the step's own keys and values, not in the pools yet.
    The kernel attends to them as each row's last position (context_lens - 1, whose slot they are) and writes them
    into the pools in place: no scatter op, and no copy of a whole pool when MLX cannot reuse its buffer (a KV scatter
    encoded while the step before it still runs on the GPU copies the pool: benchmarks/RESULTS.md, eleventh
    session). The caller orders later pool updates after this launch (engine/paged.py)."""
    check_decode_arguments(q, k_pool, v_pool, block_tables, context_lens, num_splits)
    B, Hq, D = q.shape[0], q.shape[1], q.shape[-1]  # q [B, Hq, D] or [B, Hq, 1, D]: the same memory
    _, block_size, Hkv, _ = k_pool.shape
    n_rep = Hq // Hkv
    geo = launch_geometry(D, n_rep)
    scale = D ** -0.5 if scale is None else scale
    S = num_splits
    inputs = [q, k_pool, v_pool, block_tables.astype(mx.int32), context_lens.astype(mx.int32)]
    if new_kv is not None:
        inputs += _new_kv_inputs(new_kv, k_pool, B)
    writes = new_kv is not None
    template = [("KV", k_pool.dtype), ("SCALE_BITS", _scale_bits(float(scale))), ("D", D), ("BS", block_size),
                ("HKV", Hkv), ("NREP", n_rep), ("G", geo["G"]), ("LPT", geo["LPT"]), ("EPL", geo["EPL"]),
                ("TPB", THREADS), ("UNROLL", UNROLL)]
    grid = (S * THREADS, Hkv * (n_rep // geo["G"]), B)
    if S == 1 and not _two_launches:
        (out,) = _kernel(True, writes)(inputs=inputs, template=template + [("OUT", q.dtype)], grid=grid,
                                     threadgroup=(THREADS, 1, 1), output_shapes=[q.shape], output_dtypes=[q.dtype])
        return out
    o_part, m_part, l_part = _kernel(False, writes)(
        inputs=inputs,
        template=template,
        grid=grid,
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(B, Hq, S, D), (B, Hq, S), (B, Hq, S)],
        output_dtypes=[mx.float32, mx.float32, mx.float32],
    )
    combine_threads = 256
    (out,) = _combine_kernel()(
        inputs=[o_part, m_part, l_part],
        template=[("OUT", q.dtype), ("D", D)],
        grid=(-(-B * Hq * D // combine_threads) * combine_threads, 1, 1),
        threadgroup=(combine_threads, 1, 1),
        output_shapes=[q.shape],
        output_dtypes=[q.dtype],
    )
    return out


def decode_attention_for(runner: str):
    """The decode-attention function of a runner name (as `runner_for` returns)."""
    if runner == RUNNER_OPS:
        from .paged_attention import paged_decode_attention

        return paged_decode_attention
    if runner.startswith("cuda-kernel"):
        return cuda_paged_decode_attention
    raise ValueError(f"unknown decode-attention runner {runner!r}")
