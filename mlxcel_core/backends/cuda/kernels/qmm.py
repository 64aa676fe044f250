"""4-bit x 16-bit matrix product for decode batches (6..64 rows of x) on the tensor cores, as one CUDA kernel
(``mx.fast.cuda_kernel``), for the 4-bit layers of kernels/fast_linear.py.

Why: at a decode batch of B sequences MLX 0.32 reads every 4-bit weight B times (benchmarks/RESULTS.md), and
kernels/qmv.py's matvec kernel, whose float32 multiply-adds grow with the rows, stops at 8. Here each
weight is read once for all rows and the multiply-adds run as ``mma.sync.m16n8k16`` (float32 accumulation).

y[m, n] = sum_k w[n, k] x[m, k] with w = q s + b made in x's 16-bit type (one fused multiply-add, one rounding, as a
prompt's products read their dequantized weights and MLX's quantized products do), the sums float32 across all
groups. Each weight made whole in 16 bits rather than the raw nibbles q multiplied and each group's sums scaled after
(s (q . x) + b sum(x)) leaves out the block's group sums of x and the per-group scaling of the accumulators: at 64
rows, where those grow with the rows, that is a tenth of an 8B model's batch product (benchmarks/RESULTS.md).

Layout of one warp's work: 16 weight rows (the mma's M) against 8 rows of x (its N) per tile, NT = ceil(M / 8) tiles
(NT is compiled in and M read from x's shape, so batch sizes 6..64 share eight kernels); a k-step is 16 values of K,
a group G / 16 steps. Thread (g = lane / 4, t = lane % 4) owns the group's K values t Q .. t Q + Q - 1 (Q = G / 4)
of weight rows g and g + 8, loaded at once as G / 32 whole packed words a row (one vector load), and step s takes
the 4 consecutive K values k = t Q + 4 s .. k + 3 of them and of x row g of each tile: four to eight times fewer
load instructions than 16-bit pieces. The mma's fragments put the logical K index 2t, 2t+1 (registers a0a1, b0b1)
and 2t+8, 2t+9 (a4a5, b2b3) at a thread: this kernel maps those to the physical K values k, k+1 and k+2, k+3, the
same permutation on both operands, so the products pair up. The emulation in
tests/mlxcel_core/backends/cuda/kernels/test_qmm.py follows this mapping and the PTX fragment layouts index by index.

Data movement: a block's 8 warps (128 weight rows) share x. The block copies a chunk of it (all rows, CHUNK_K values of
K) into shared memory with cp.async, the next chunk copying while the warps compute on this one (two buffers); rows are
padded by 8 bytes, so a warp's 8-byte reads of 4 rows by 4 offsets hit 16 different bank pairs (no conflict), and rows M
.. 8 NT - 1 hold zeros. Each warp keeps D groups of its weights (words, scales, biases) in flight in a ring of
registers, loading a group D groups before its turn. Why: where each warp loads its own x from global memory (8 bytes at
a time, 8 rows by 4 offsets: 32 sectors touched, a quarter of each used) and a group's weights only when the group
starts, every warp waits a memory latency a group (benchmarks/RESULTS.md has the whole decode step both ways). Eight
warps rather than four a block halve what staging and reordering x costs a weight row (benchmarks/RESULTS.md, the
kernels-alone table, has the two side by side). The staging loop finds a piece's row and offset by a power of two (the
pieces of a whole chunk's row), not a division.

The block passes once over each staged chunk, behind a second barrier, and reorders each 8 values of x as x0 x4 x1
x5 x2 x6 x3 x7, so that a warp makes a register of two weights from a whole packed word with one AND-OR (nibbles 0 and
4, then 1 and 5, ...: mlxcel_qmm_pair4) and one fused multiply-add (mlxcel_qmm_dequant2); the tensor cores see the
same products, in another order of K within a step. The kernel is compiled with __launch_bounds__(256, MIN_BLOCKS), at
most 128 registers a thread, so two blocks (16 warps) fit an SM.
The pass and the reorder cut the sm_90 code a group of 16 tensor-core products takes by half (benchmarks/qmm_sass.py
counts it) and lift an 8B model's 4-bit decode at 32 and 64 rows by about a tenth (benchmarks/RESULTS.md).

A decode batch of 33..64 rows runs as one launch of up to 8 tiles (NT 5..8, each weight read once, not once a launch
of 32 rows). Past 4 tiles the accumulators take more registers (still at most 128 a thread in groups of 64 or 128, so
two blocks an SM; one in groups of 32, which spill at 128) and a chunk stages half as much of K, so that the chunk
buffers stay within 48 KiB of shared memory.

blockIdx.y splits K (SPLITS parts of GPS groups) so that narrow weights still fill the GPU; each split writes float32
partial sums [SPLITS, M, N], which are summed and cast after the launch.
"""

from __future__ import annotations

import functools
import hashlib

import mlx.core as mx

from . import qmv
from .cubin_cache import cuda_kernel
from .matvec_config import QMM_TARGET_BLOCKS as TARGET_BLOCKS  # noqa: F401
from .matvec_config import qmm_split_k as split_k  # the untuned rule
from .qmm_source import CHUNK_K  # noqa: F401  (values of K a block stages in shared memory at a time)
from .qmm_source import HEADER as _HEADER
from .qmm_source import SOURCE as _SOURCE

MAX_ROWS = 64  # rows of x one launch takes (8 tiles of 8)
NARROW_ROWS = 32  # rows of x (4 tiles) up to which every group size fits MIN_BLOCKS blocks an SM
WARPS = 8  # a block's warps, 16 weight rows each
ROWS_PER_BLOCK = 16 * WARPS
X_TYPES = (mx.bfloat16, mx.float16)
# Blocks an SM: registers capped at 65536 / (256 * 2) = 128 a thread, which the kernel needs no spill for
MIN_BLOCKS = 2
MIN_BLOCKS_WIDE_G32 = 1  # past NARROW_ROWS rows in groups of 32, which spilled at 128 registers before the weights
# were made in 16 bits (now 122, no spill: whether two blocks win there is h200_kernels.sh qmmblocks's question)

# The name carries a hash of the source and of the block's warps (the source reads them from blockDim; tuned splits
# are keyed on the name): MLX caches compiled kernels on disk by name (see kernels/qmv.py).
KERNEL_NAME = f"mlxcel_qmm_mma_{hashlib.sha256((_HEADER + _SOURCE + f'/{WARPS}').encode()).hexdigest()[:8]}"


@functools.cache
def _kernel(min_blocks: int = MIN_BLOCKS):
    """The kernel, its registers capped so that `min_blocks` blocks fit an SM."""
    header, source = kernel_source()
    return cuda_kernel(
        name=KERNEL_NAME,
        input_names=["x", "w", "scales", "biases"],
        output_names=["partial"],
        source=source,
        header=header,
        launch_bounds=(WARPS * 32, min_blocks),
    )


def kernel_source() -> tuple[str, str]:
    """(header, body) as MLX's cuda_kernel assembles them (the compile test's input)."""
    return _HEADER, _SOURCE


def chosen_gps(n: int, k: int, m: int, group_size: int, x_dtype) -> int:
    """Groups of K a split for a launch: the autotune cache's winner for this cell where MLXCEL_AUTOTUNE reads the
    cache and one is stored (`mlxcel tune --op qmm-splits`, autotune/matvec_ops.py), else `split_k`'s rule."""
    from autotune.matvec_ops import QMM, tuned_config

    tuned = tuned_config(QMM, n, k, m, group_size, "plain", x_dtype)
    return tuned[0] if tuned else split_k(n, k // group_size)[1]


@functools.lru_cache(maxsize=1024)
def launch_args(
    x_shape: tuple,
    x_dtype,
    s_dtype,
    n: int,
    k: int,
    group_size: int,
    gps: int | None = None,
) -> dict | None:
    """Everything but the inputs of one launch for x (any leading shape, 1..MAX_ROWS rows of K) and an N x K 4-bit
    weight, or None where the kernel does not take it (other types, group sizes, too many rows). `gps` (groups of K a
    split) overrides `chosen_gps`."""
    m = qmv.rows_of(x_shape)
    if (
        not 1 <= m <= MAX_ROWS
        or x_dtype not in X_TYPES
        or group_size not in qmv.GROUP_SIZES
        or k % group_size
        or x_shape[-1] != k
        or s_dtype not in qmv.FLOAT_TYPES
    ):
        return None
    groups = k // group_size
    gps = gps or chosen_gps(n, k, m, group_size, x_dtype)
    splits = -(-groups // gps)
    return dict(
        template=[
            ("T", x_dtype),
            ("S", s_dtype),
            ("G", group_size),
            ("NT", -(-m // 8)),
            ("GPS", gps),
        ],
        grid=(-(-n // ROWS_PER_BLOCK) * WARPS * 32, splits, 1),
        threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(splits, m, n)],
        output_dtypes=[mx.float32],
    )


def quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int,
    gps: int | None = None,
) -> mx.array:
    """x @ dequantize(w, scales, biases).T on the kernel (CUDA only; the caller has checked `launch_args`), in
    mx.result_type(x, scales) like mx.quantized_matmul. `gps` overrides the groups of K a split."""
    n, k = w.shape[0], w.shape[1] * 8
    args = launch_args(x.shape, x.dtype, scales.dtype, n, k, group_size, gps)
    if args is None:
        raise ValueError(
            f"the 4-bit mma kernel takes 1..{MAX_ROWS} rows of bfloat16/float16 with K a multiple of "
            f"the group size, got x of shape {x.shape} and {x.dtype}, group size {group_size}"
        )
    narrow = qmv.rows_of(x.shape) <= NARROW_ROWS or group_size > 32
    partial = _kernel(MIN_BLOCKS if narrow else MIN_BLOCKS_WIDE_G32)(inputs=[x, w, scales, biases], **args)[0]
    # (one split: a reshape, which is free; MLX makes `partial[0]` a gather kernel, a launch per call)
    y = partial.reshape(partial.shape[1:]) if partial.shape[0] == 1 else partial.sum(axis=0)
    return y.astype(mx.result_type(x.dtype, scales.dtype)).reshape(*x.shape[:-1], n)
