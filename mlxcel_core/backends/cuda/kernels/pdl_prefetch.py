"""The experiment MLXCEL_PDL_PREFETCH (settings.py; issue 42): kernels of a decode step ask L2 for what they will read
that no earlier kernel of the step writes, before they wait for the previous kernel:
- the matvec kernels (kernels/qmv_source.py, both weight kinds): the first share of their block's weight rows (and of
  the 4-bit kernel's scales and biases), one bulk request a row, at most the setting's MiB over a launch's rows (a
  whole large matrix asked for at once may not stay in L2 until its blocks read it);
- the paged attention kernel (backends/cuda/paged_attention_source.py): the keys and values of its split's first
  tokens (one a thread, a request a 32-byte sector) from the pools, which earlier steps wrote. The block tables and
  context lengths it reads to find them are the step's ints, uploaded before the replayed graph's first kernel
  (graph_decode.py), and a kernel chained by PDL starts only after the one two launches before it has ended. The
  step's own keys and values (the previous kernel's output) and their write into the pools stay after the wait.
Where kernels chain by programmatic dependent launch (a decode step replayed on sm_90 or newer:
kernels/cubin_cache.py), a kernel's blocks are placed while the previous kernel's last ones run, so those reads
overlap that kernel's end instead of starting after it. Elsewhere the prefetch is compiled out. Imports nothing
(autotune names the kernels without MLX)."""

from __future__ import annotations

# Where a body's PDL wait goes, on a line of its own (cubin_cache.kernel_text puts PDL_PROLOGUE there instead of at the
# top): what comes before it must read nothing an earlier kernel writes and write nothing (it may run while the
# previous kernel does). Such a body's translation unit defines PDL_EARLY (1 with the prologue at the marker, 0 without
# PDL) for the work ahead of the wait; MLX's own build of the body (the fallback) leaves it undefined: `#if` reads 0.
PDL_WAIT = "/*PDL_WAIT*/"


def budget() -> int:
    """MLXCEL_PDL_PREFETCH in bytes (0: off), read where a kernel is first built (the kernel factories cache their
    kernels)."""
    from mlxcel_core import settings  # (no MLX)

    return settings.get("MLXCEL_PDL_PREFETCH") << 20


def enabled() -> bool:
    """Whether the experiment is on (the paged kernel's prefetch takes no budget)."""
    return budget() > 0


def matvec_share(budget_bytes: int) -> str:
    """The matvec kernels' share of each row to ask for, for a launch budget of `budget_bytes` (its text carries the
    budget, so kernel names differ by it)."""
    return f"""
#define PDL_PREFETCH_BYTES {int(budget_bytes)}ull
// The bytes of each of a launch's `rows` rows of `row_bytes` to ask L2 for: the whole row, or the first multiple of
// 16 bytes that keeps the launch within PDL_PREFETCH_BYTES.
__device__ __forceinline__ unsigned mlxcel_prefetch_share(unsigned row_bytes, int rows) {{
    const unsigned cap = unsigned(PDL_PREFETCH_BYTES / (unsigned long long)(rows > 0 ? rows : 1)) & ~15u;
    return row_bytes < cap ? row_bytes : cap;
}}
"""


PREFETCH_HELPER = r"""
// `bytes` from p into L2, one bulk request (sm_90+); nothing where p or bytes is not a multiple of 16.
__device__ __forceinline__ void mlxcel_prefetch_l2(const void* p, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (bytes != 0 && ((reinterpret_cast<size_t>(p) | bytes) & 15) == 0) {
        asm volatile("{ .reg .u64 g; cvta.to.global.u64 g, %0; cp.async.bulk.prefetch.L2.global [g], %1; }\n"
                     :: "l"(p), "r"(bytes) : "memory");
    }
#endif
}

// `bytes` from p into L2 by one request per 32-byte sector: for addresses that differ across a warp's threads, where
// the bulk form's uniform operands would make the warp issue them one thread at a time.
__device__ __forceinline__ void mlxcel_prefetch_l2_sectors(const void* p, unsigned bytes) {
    for (unsigned o = 0; o < bytes; o += 32) {
        asm volatile("prefetch.L2 [%0];\n" :: "l"(static_cast<const char*>(p) + o));
    }
}
"""

# Per weight kind: thread r of a group (of the block's warps) asks for row r; PDL_EARLY is cubin_cache's.
_EARLY = {
    "q4": """#if PDL_EARLY
    const unsigned pf_w = mlxcel_prefetch_share(unsigned(KW) * 4u, N);
    const unsigned pf_s = unsigned((unsigned long long)(G * sizeof(S)) * pf_w / (unsigned(KW) * 4u)) & ~15u;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        if (gtid == r) {
            mlxcel_prefetch_l2(w_row[r], pf_w);
            mlxcel_prefetch_l2(s_row[r], pf_s);
            mlxcel_prefetch_l2(b_row[r], pf_s);
        }
    }
#endif
""",
    "half": """#if PDL_EARLY
    const unsigned pf_w = mlxcel_prefetch_share(unsigned(K * sizeof(W)), N);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        if (gtid == r) {
            mlxcel_prefetch_l2(w_row[r], pf_w);
        }
    }
#endif
""",
}
_BEFORE_ACC = "    float acc[ROWS][M];\n"  # (both main loops: the rows are known, nothing read yet)


def with_prefetch(body: str, weights: str) -> str:
    """The main loop's text (`weights` "q4" or "half") with the prefetch and the wait where its rows are known and
    nothing is read yet."""
    if _BEFORE_ACC not in body:
        raise ValueError("the matvec main loop no longer declares its accumulators where the prefetch goes")
    return body.replace(_BEFORE_ACC, _EARLY[weights] + PDL_WAIT + "\n" + _BEFORE_ACC, 1)


# The paged kernel: after its prologue has found the split's tokens t0..t1, before the step's keys and values.
_PAGED_EARLY = """#if PDL_EARLY
    if (tid < t1 - t0) {
        const int tok = t0 + tid;
        const size_t at = ((size_t(block_tables[size_t(b) * max_blocks + tok / BS]) * BS + tok % BS) * HKV + kvh) * D;
        mlxcel_prefetch_l2_sectors(k_pool + at, unsigned(D * sizeof(KV)));
        mlxcel_prefetch_l2_sectors(v_pool + at, unsigned(D * sizeof(KV)));
    }
#endif
"""
_NEW_KV = "/*NEW_KV*/"


def paged_with_prefetch(source: str) -> str:
    """The paged kernel's text (before its NEW_KV marker is filled) with the prefetch and the wait."""
    if _NEW_KV not in source:
        raise ValueError("the paged kernel no longer marks where the step's keys and values come in")
    return source.replace(_NEW_KV, _PAGED_EARLY + PDL_WAIT + "\n" + _NEW_KV, 1)
