"""The experiment MLXCEL_PDL_PREFETCH (settings.py; issue 42): the decode matvec kernels (kernels/qmv_source.py, both
weight kinds) ask L2 for their block's weight rows (and the 4-bit kernel's scales and biases), one bulk request a row,
before they wait for the previous kernel, which those rows do not depend on. Where kernels chain by programmatic
dependent launch (a decode step replayed on sm_90 or newer: kernels/cubin_cache.py), a kernel's blocks are placed while
the previous kernel's last ones run, so the weights' read overlaps that kernel's end instead of starting after it.
Elsewhere the prefetch is compiled out. Imports nothing (autotune names the kernels without MLX)."""

from __future__ import annotations

PDL_WAIT = "/*PDL_WAIT*/"  # where a body's PDL wait goes (cubin_cache.kernel_text: what comes before reads no input
# an earlier kernel writes, and writes nothing)

PREFETCH_HELPER = r"""
// `bytes` from p into L2, one bulk request (sm_90+); nothing where p or bytes is not a multiple of 16.
__device__ __forceinline__ void mlxcel_qmv_prefetch_l2(const void* p, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (bytes != 0 && ((reinterpret_cast<size_t>(p) | bytes) & 15) == 0) {
        asm volatile("{ .reg .u64 g; cvta.to.global.u64 g, %0; cp.async.bulk.prefetch.L2.global [g], %1; }\n"
                     :: "l"(p), "r"(bytes) : "memory");
    }
#endif
}
"""

# Per weight kind: thread r of a group (of the block's warps) asks for row r; PDL_EARLY is cubin_cache's.
_EARLY = {
    "q4": """#if PDL_EARLY
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        if (gtid == r) {
            mlxcel_qmv_prefetch_l2(w_row[r], unsigned(KW) * 4u);
            mlxcel_qmv_prefetch_l2(s_row[r], unsigned(G * sizeof(S)));
            mlxcel_qmv_prefetch_l2(b_row[r], unsigned(G * sizeof(S)));
        }
    }
#endif
""",
    "half": """#if PDL_EARLY
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        if (gtid == r) {
            mlxcel_qmv_prefetch_l2(w_row[r], unsigned(K * sizeof(W)));
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
