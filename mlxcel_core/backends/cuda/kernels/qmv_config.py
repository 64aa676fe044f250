"""The 4-bit matvec kernel's launch configuration (kernels/qmv.py), as plain Python: the untuned rule and the
candidates `mlxcel tune --op qmv-multirow` measures (autotune/qmv_op.py reads both without importing MLX)."""

from __future__ import annotations

CHUNK = 32  # elements of K per lane per chunk (one uint4 of packed weights)
ROWS = (2, 4, 8)  # output rows per block: even, as the fused swiglu and rope modes need
WARPS = (1, 2, 4, 8)


def candidates(k: int) -> list[tuple[int, int, int]]:
    """(ROWS, WARPS, UNROLL) configurations worth measuring for a weight K wide: every ROWS x WARPS with UNROLL 1
    (UNROLL 2 never won benchmarks/qmv.py's sweeps), where each warp keeps at least one whole 1024-element round of
    K; the rule's choice is always among them."""
    return [(rows, warps, 1) for rows in ROWS for warps in WARPS if warps == 1 or warps * 32 * CHUNK <= k]


def launch_config(n: int, k: int, m: int) -> tuple[int, int, int]:
    """(ROWS, WARPS, UNROLL) for an N x K weight and m rows of x.

    ROWS output rows per block: 8 for long rows (K > 4096) or very many of them (N > 16384), else 4. WARPS warps per
    block split K (each warp keeps at least one whole 1024-element round of K) until the grid has about 2048 warps
    (~16 per SM on an H200). UNROLL 1. This reproduces the fastest configuration benchmarks/qmv.py --sweep finds on
    the H200 (M=1, measured on an earlier build of this kernel) for 4096x4096 (4,2,1), 14336x4096 (4,1,1),
    4096x14336 (8,4,1) and 128256x4096 (8,1,1); for 1024x4096 it finds (8,2,1), 1.1x this rule's (4,4,1). UNROLL 2
    never wins there (its registers cost occupancy). Re-run the sweep after changing the kernel. That sweep's calls
    overlap in MLX's CUDA graphs; timed one after another the best configurations are 1.0-1.2x this rule's, and in a
    model the launches reach 24-36% occupancy (128 registers a thread in the residual and SwiGLU modes): what to look
    at next for this kernel."""
    rows = 8 if k > 4096 or n > 16384 else 4
    blocks = -(-n // rows)
    warps = 1
    while warps < 8 and blocks * warps < 2048 and k >= warps * 2 * 32 * CHUNK:
        warps *= 2
    return rows, warps, 1
