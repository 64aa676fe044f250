"""The decode product kernels' launch configurations, as plain Python: the untuned rules and the candidates
`mlxcel tune --op qmv-multirow|hmv-multirow|qmm-splits` measures (autotune/matvec_ops.py reads both without importing
MLX). The matvecs (kernels/qmv.py for 4-bit weights, kernels/hmv.py for 16-bit) take (ROWS, WARPS, UNROLL): output
rows a block (even, as the fused SwiGLU and RoPE modes need), warps splitting K, and chunks of K whose loads are in
flight at once. The tensor-core batched product (kernels/qmm.py) takes GPS: quantization groups of K a split (the grid's
second dimension splits K so that narrow weights still fill the GPU)."""

from __future__ import annotations

from .qmv_source import base_mode

QMV_CHUNK = 32  # elements of K per lane per chunk of the 4-bit kernel (one uint4 of packed weights)
HMV_CHUNK = 8  # elements of K per lane per step of the 16-bit kernel (one 16-byte load of a weight row)
WARPS = (1, 2, 4, 8)
QMM_ROWS_PER_BLOCK = 128  # qmm.ROWS_PER_BLOCK: 8 warps of 16 weight rows
QMM_TARGET_BLOCKS = 132  # about one block (8 warps) per SM of an H200 (132 SMs): split K until the grid has as many


def _candidates(k: int, chunk: int, rows: tuple[int, ...], unrolls: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """Every ROWS x WARPS x UNROLL where each warp keeps at least one whole round (32 lanes x chunk) of K."""
    return [(r, w, u) for r in rows for w in WARPS for u in unrolls if w == 1 or w * 32 * chunk <= k]


def qmv_candidates(k: int) -> list[tuple[int, int, int]]:
    """4-bit: ROWS 2/4/8 x WARPS 1/2/4/8, UNROLL 1 (UNROLL 2 never won benchmarks/qmv.py's sweeps); the rule's
    choice is always among them."""
    return _candidates(k, QMV_CHUNK, (2, 4, 8), (1,))


def hmv_candidates(k: int) -> list[tuple[int, int, int]]:
    """16-bit: ROWS 2/4 x WARPS 1/2/4/8 x UNROLL 1/2 (benchmarks/hmv.py's winners are all 2-4 rows); the rule's
    choice is always among them."""
    return _candidates(k, HMV_CHUNK, (2, 4), (1, 2))


def qmv_launch_config(n: int, k: int, m: int) -> tuple[int, int, int]:
    """(ROWS, WARPS, UNROLL) of the 4-bit kernel for an N x K weight and m rows of x.

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
    while warps < 8 and blocks * warps < 2048 and k >= warps * 2 * 32 * QMV_CHUNK:
        warps *= 2
    return rows, warps, 1


def hmv_launch_config(n: int, k: int, m: int, mode: str = "plain") -> tuple[int, int, int]:
    """(ROWS, WARPS, UNROLL) of the 16-bit kernel: two rows a block; as many warps (up to 8) splitting K as leave each
    two rounds of it (512 elements a lane-round of 8 warps); both of a lane's rounds' loads in flight (UNROLL 2) where
    it has two.

    Why: a decode projection waits for the one before it, so one launch must keep enough loads in flight on its own.
    A rule that stops at about 2048 warps a grid reaches 24-42% achieved occupancy in the model on the H200 (1.9-2.9
    TB/s); a sweep whose independent calls overlap inside MLX's CUDA graphs does not show that. Timed one after
    another (benchmarks/hmv.py), the best configurations at M = 1 are all 2-4 rows, 4-8 warps, mostly UNROLL 2:
    4096x4096 (4,4,2), 14336x4096 (2,8,2), 4096x14336 (2,4,1), 128256x4096 (2,8,2), 8192x2048 (2,4,2), 2048x8192
    (4,8,2), 128256x2048 (2,4,2), and this rule is within a few percent of each.

    The SwiGLU modes (gate and up rows in one launch) take at most 4 warps: inside an 8B decode
    (benchmarks/inmodel_sweep.py) their launch takes 58-60 us with 4 warps a block against 68 us with 8; the other
    modes are within noise of the rule."""
    warps = 4 if base_mode(mode) == "swiglu" else 8
    while warps > 1 and k < warps * 2 * 32 * HMV_CHUNK:
        warps //= 2
    rounds = k // (warps * 32 * HMV_CHUNK)
    return 2, warps, 2 if rounds >= 2 else 1


def qmm_split_k(n: int, groups: int) -> tuple[int, int]:
    """(SPLITS, GPS) of the tensor-core product: K in SPLITS parts of GPS groups each (the last may be shorter), enough
    parts that the grid has about QMM_TARGET_BLOCKS blocks."""
    tiles = -(-n // QMM_ROWS_PER_BLOCK)
    want = max(1, min(groups, -(-QMM_TARGET_BLOCKS // tiles)))
    gps = -(-groups // want)
    return -(-groups // gps), gps


def qmm_candidates(n: int, groups: int) -> list[int]:
    """GPS values worth measuring: K whole, then split in 2, 4, 8, ... parts (while there are groups enough), and the
    rule's."""
    out, parts = [], 1
    while parts <= groups:
        out.append(-(-groups // parts))
        parts *= 2
    out.append(qmm_split_k(n, groups)[1])
    return sorted(set(out), reverse=True)
