"""Paged decode attention as one CUDA kernel with a split-K launch parameter (``mx.fast.cuda_kernel``).

Same contract and results as ``paged_attention.paged_decode_attention`` (the MLX-ops path, which runs
on every backend and stays the fallback): q [B, Hq, D] or [B, Hq, 1, D], pools [num_blocks, block_size, Hkv,
D], block_tables int [B, max_blocks], context_lens int [B]; returns q's shape and dtype, zeros for a row whose
context is empty.

Kernel ("paged_decode_split"): one thread block per (split, kv head x query-head group, row). A row's
context (a sliding-window layer's: its last WINDOW positions; a chunked layer's: its own CHUNK) is cut into
``num_splits`` contiguous chunks of ceil(len / num_splits) tokens; the block of split
s walks its chunk straight through the block table (no gather): NVG lane groups of LPT lanes, each
group with UNROLL tokens' loads in flight, each lane holding EPL elements of the head dim. Every lane
group keeps an online softmax (running max m, sum l, weighted V) in float32 for the G query heads that
share the kv head,
so K and V are read once per kv head, not once per query head. The groups' states are merged in shared
memory and the block writes its split's partial max [B, Hq, S], sum [B, Hq, S] and unnormalized
output [B, Hq, S, D] (float32). The combine step ("paged_decode_combine", a second small kernel; the same
arithmetic as `combine_partials` in MLX ops) rescales the partials by exp(m_s - max m) and divides,
exactly as the ops path merges its splits, writing q's dtype. With one split the kernel writes the output itself
("paged_decode_one_split", the combine's arithmetic for S = 1 in the same launch): one launch a layer. So it is with
several splits when the caller keeps `counters` ("paged_decode_split_combine": the last of a head group's blocks to
finish combines them; the CUDA backend gives engine/paged.py one counter array per layer).
The kernel sources are in paged_attention_source.py.

Bodies: where q and the pools share a 16-bit type and the head dim is a multiple of 32 up to 128 (`takes_mma`: a
bf16 / fp16 model with 64- or 128-wide heads, say; not Gemma's 256), the block's 4 warps take 8-token tiles on the
tensor cores (paged_attention_mma.py; G up to 8 query heads a block); else LPT-lane groups take one token at a time
in float32 (benchmarks/RESULTS.md, the kernels-alone table, has the two bodies side by side). The lane groups' body:

Tiles: a lane group keeps UNROLL = 2 tokens' keys and values as loaded (16-bit values: half a float's registers), in
two buffers used alternately, so that the next tile's loads are in flight while this tile's arithmetic runs, and it
takes one softmax maximum, one rescale of its G x EPL accumulators and UNROLL exponentials a tile
(paged_attention_tile.py; 128 registers a thread, four blocks an SM, no spill). Why: at long contexts the kernel is
bound by its reads of the layer's KV, and a lane group that converted each token to float32 and updated its softmax
before issuing its next loads left the memory idle meanwhile (benchmarks/RESULTS.md has the figures).

``num_splits`` is the grid's x extent: every value is the same compiled kernel. The kernel is compiled
once per (dtypes, D, block_size, Hkv, n_rep, body) at first use (NVRTC).

Validated on the device by tests/mlxcel_core/backends/cuda/test_cuda_paged_attention.py (skipped without CUDA).
No Metal kernel exists: on Apple silicon, as on CPU, the ops path runs.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx

from mlxcel_core.kv.paged_attention import RUNNER_OPS, check_decode_arguments, check_limits

from .kernels import pdl_prefetch
from .kernels.pdl_prefetch import PREFETCH_HELPER
from .paged_attention_source import (
    MMA_DTYPES,
    MMA_HEADER,
    RUNNER_CUDA,
    THREADS,
    UNROLL,
    combine_source,
    geometry,
    kernel_source,
    mma_head_dim,
)
from .small_arrays import float32_bits

MAX_HEAD_DIM = 1024


MMA_TYPES = tuple(getattr(mx, name) for name in MMA_DTYPES)


def takes_mma(q_dtype, kv_dtype, head_dim: int) -> bool:
    """Whether the tensor-core body (paged_attention_mma.py) takes these: q in the pools' 16-bit type (its products
    take q as it is) and a head dim it takes (`mma_head_dim`)."""
    return q_dtype == kv_dtype and kv_dtype in MMA_TYPES and mma_head_dim(head_dim)


def launch_geometry(head_dim: int, n_rep: int, mma: bool = False) -> dict[str, int]:
    """Lanes per token (LPT), head-dim elements per lane (EPL) and query heads per block (G).

    LPT is the smallest power of two (<= 32) giving each lane at most 8 elements; G is the largest
    divisor of n_rep with G x EPL <= 32 registers of query and of accumulator per lane. With `mma` (the
    tensor-core body: a warp's 32 lanes share its tokens) LPT is 32 and G the largest divisor of n_rep up to 8."""
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"the CUDA paged-decode kernel supports head_dim 1..{MAX_HEAD_DIM}, got {head_dim}")
    return geometry(head_dim, n_rep, mma)


@functools.cache
def cuda_kernel_available() -> bool:
    """True when MLX has a CUDA backend with a usable device (the kernel can be JIT-compiled)."""
    try:
        return bool(getattr(mx, "cuda", None) and mx.cuda.is_available() and hasattr(mx.fast, "cuda_kernel"))
    except Exception:
        return False


COUNTERS = 4096  # combine counters a caller keeps per layer: rows x head groups up to this use the one-launch form


def runner_for(head_dim: int) -> str:
    """Which implementation decode attention runs on here: the CUDA kernel or the MLX-ops path."""
    return RUNNER_CUDA if cuda_kernel_available() and head_dim <= MAX_HEAD_DIM else RUNNER_OPS


INPUTS = ("q", "k_pool", "v_pool", "block_tables", "context_lens")
NEW_KV_INPUTS = ("k_new", "v_new", "slot_blocks", "slot_offsets")


@functools.cache
def _kernel(
    one_split: bool = False,
    new_kv: bool = False,
    last_block_combines: bool = False,
    sinks: bool = False,
    mma: bool = False,
):
    from .kernels.cubin_cache import cuda_kernel  # (here: the kernels package imports this module)

    kind = "one_split" if one_split else ("split_combine" if last_block_combines else "split")
    takes_sinks = sinks and (one_split or last_block_combines)  # (a split's partials never read them)
    early = pdl_prefetch.enabled()
    depth = mma_depth() if mma else 2
    suffix = f"{'_new_kv' if new_kv else ''}{'_sinks' if takes_sinks else ''}{'_mma' if mma else ''}"
    suffix += ("_early" if early else "") + (f"_depth{depth}" if depth != 2 else "")
    return cuda_kernel(
        name=f"paged_decode_{kind}{suffix}",
        input_names=[
            *INPUTS,
            *(NEW_KV_INPUTS if new_kv else ()),
            *(("counters",) if last_block_combines else ()),
            *(("sinks",) if takes_sinks else ()),
        ],
        output_names=["out"]
        if one_split
        else [*(("out",) if last_block_combines else ()), "o_part", "m_part", "l_part"],
        source=kernel_source(one_split, new_kv, last_block_combines, takes_sinks, mma, early, depth),
        header=(MMA_HEADER if mma else "") + (PREFETCH_HELPER if early else ""),
    )


def mma_depth() -> int:
    """The experiment MLXCEL_PAGED_MMA_DEPTH (settings.py): tiles of keys and values a warp of the tensor-core body
    keeps in registers, read where a kernel is first built (`_kernel` caches it)."""
    from mlxcel_core import settings

    return settings.get("MLXCEL_PAGED_MMA_DEPTH")


@functools.cache
def _combine_kernel(sinks: bool = False):
    from .kernels.cubin_cache import cuda_kernel

    return cuda_kernel(
        name=f"paged_decode_combine{'_sinks' if sinks else ''}",
        input_names=["o_part", "m_part", "l_part", *(("sinks",) if sinks else ())],
        output_names=["out"],
        source=combine_source(sinks),
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


def cuda_paged_decode_attention(
    q,
    k_pool,
    v_pool,
    block_tables,
    context_lens,
    num_splits: int = 1,
    scale: float | None = None,
    new_kv: tuple | None = None,
    counters: mx.array | None = None,
    window: int | None = None,
    chunk: int | None = None,
    sinks: mx.array | None = None,
    softcap: float | None = None,
    mma: bool | None = None,
    _two_launches: bool = False,
) -> mx.array:
    """``paged_decode_attention`` on the CUDA kernel (needs the CUDA backend; see the module docstring). One split
    is one launch (the split kernel writes the output itself); so are several splits given `counters` (int32 zeros,
    at least rows x head groups of them, kept by the caller from launch to launch: `_LAST_BLOCK_COMBINES`); else,
    and with `_two_launches` (tests), split + combine.

    new_kv = (k, v [B, Hkv, D], slot_blocks, slot_offsets [B]): the step's own keys and values, not in the pools yet.
    The kernel attends to them as each row's last position (context_lens - 1, whose slot they are) and writes them
    into the pools in place: no scatter op, and no copy of a whole pool when MLX cannot reuse its buffer (a KV scatter
    encoded while the step before it still runs on the GPU copies the pool). The caller orders later pool updates
    after this launch (engine/paged.py).

    `window`, `chunk`: a sliding-window or chunked layer's (the ops path's), the kernel's WINDOW and CHUNK template
    constants: the splits cut only the row's last `window` positions, or its own chunk's. `sinks` [Hq] (gpt-oss): each
    head's sink logit joins the softmax where the output is normalized (the ops path's `sinks`). `softcap` (Gemma 2):
    the scores' soft-capping, the SOFTCAP_BITS template constant (its float32 bits; 0 without). `mma`: the
    tensor-core body where it takes the inputs (`takes_mma`; None or True), else the lane groups' (False)."""
    check_decode_arguments(q, k_pool, v_pool, block_tables, context_lens, num_splits)
    check_limits(window, chunk, softcap)
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise ValueError(f"sinks must be [Hq={q.shape[1]}], got shape {sinks.shape}")
    with_sinks = [] if sinks is None else [sinks]  # (read in their own dtype: no conversion op in the step)
    B, Hq, D = q.shape[0], q.shape[1], q.shape[-1]  # q [B, Hq, D] or [B, Hq, 1, D]: the same memory
    Hkv = k_pool.shape[2]
    mma = takes_mma(q.dtype, k_pool.dtype, D) and mma is not False
    geo = launch_geometry(D, Hq // Hkv, mma)
    S = num_splits
    inputs = [q, k_pool, v_pool, block_tables.astype(mx.int32), context_lens.astype(mx.int32)]
    if new_kv is not None:
        inputs += _new_kv_inputs(new_kv, k_pool, B)
    writes = new_kv is not None
    template = _template(q, k_pool, geo, scale, window, chunk, softcap)
    grid = (S * THREADS, Hkv * (Hq // Hkv // geo["G"]), B)
    if S == 1 and not _two_launches:
        (out,) = _kernel(True, writes, False, sinks is not None, mma)(
            inputs=inputs + with_sinks,
            template=template + [("OUT", q.dtype)],
            grid=grid,
            threadgroup=(THREADS, 1, 1),
            output_shapes=[q.shape],
            output_dtypes=[q.dtype],
        )
        return out
    combining = counters is not None and not _two_launches
    return _launch_splits(inputs, template, grid, q, geo, writes, counters if combining else None, with_sinks, mma)


def _launch_splits(
    inputs, template, grid, q, geo: dict, writes: bool, counters, with_sinks: list, mma: bool
) -> mx.array:
    """Several splits: one launch whose last block of each head group merges them (given `counters` and room for
    the merge), else the split launch and the combine launch."""
    B, Hq, D = q.shape[0], q.shape[1], q.shape[-1]
    S = grid[0] // THREADS
    partials = [(B, Hq, S, D), (B, Hq, S), (B, Hq, S)]
    # (the last block stages 2 G S floats in the merge's shared memory, NVG G D of them)
    fits = 2 * S <= (THREADS // geo["LPT"]) * D
    sinks = bool(with_sinks)
    if counters is not None and counters.size >= grid[1] * B and fits:
        if counters.dtype != mx.int32:
            raise ValueError(f"combine counters must be int32, got {counters.dtype}")
        out, *_ = _kernel(False, writes, True, sinks, mma)(
            inputs=inputs + [counters] + with_sinks,
            template=template + [("OUT", q.dtype)],
            grid=grid,
            threadgroup=(THREADS, 1, 1),
            output_shapes=[q.shape, *partials],
            output_dtypes=[q.dtype, mx.float32, mx.float32, mx.float32],
        )
        return out
    o_part, m_part, l_part = _kernel(False, writes, mma=mma)(
        inputs=inputs,
        template=template,
        grid=grid,
        threadgroup=(THREADS, 1, 1),
        output_shapes=partials,
        output_dtypes=[mx.float32, mx.float32, mx.float32],
    )
    return _combine(o_part, m_part, l_part, with_sinks, q)


def _template(q, k_pool, geo: dict, scale: float | None, window, chunk, softcap) -> list:
    """The split kernel's template constants but its output dtype: the pools' layout, the launch geometry and the
    layer's attention options, each a compile-time constant."""
    _, block_size, Hkv, D = k_pool.shape
    scale = D**-0.5 if scale is None else scale
    return [
        ("KV", k_pool.dtype),
        ("SCALE_BITS", _scale_bits(float(scale))),
        ("D", D),
        ("BS", block_size),
        ("HKV", Hkv),
        ("NREP", q.shape[1] // Hkv),
        ("G", geo["G"]),
        ("LPT", geo["LPT"]),
        ("EPL", geo["EPL"]),
        ("TPB", THREADS),
        ("UNROLL", UNROLL),
        ("WINDOW", int(window or 0)),
        ("CHUNK", int(chunk or 0)),
        ("SOFTCAP_BITS", 0 if softcap is None else float32_bits(float(softcap))),
    ]


def _combine(o_part: mx.array, m_part: mx.array, l_part: mx.array, with_sinks: list, q: mx.array) -> mx.array:
    """The combine kernel's launch: the splits' partial outputs merged into q's shape and dtype."""
    B, Hq, D = q.shape[0], q.shape[1], q.shape[-1]
    combine_threads = 256
    (out,) = _combine_kernel(bool(with_sinks))(
        inputs=[o_part, m_part, l_part] + with_sinks,
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
        from mlxcel_core.kv.paged_attention import paged_decode_attention

        return paged_decode_attention
    if runner.startswith("cuda-kernel"):
        return cuda_paged_decode_attention
    raise ValueError(f"unknown decode-attention runner {runner!r}")
