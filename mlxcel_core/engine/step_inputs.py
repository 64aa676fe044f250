"""A step's integer inputs (positions, slots, context lengths, block tables) as views of ONE host-built array.

Why: on CUDA, MLX keeps every array in managed memory, and arrays of <= 8 bytes (a batch-1 step's position, slot or
context length) share the pages of one small-block pool (mlx/backend/cuda/allocator.cpp in MLX 0.32). Our reading of
the measurements (not traced further): a kernel that reads such a scalar stalls on page migration whenever the host
has just written into the same page, as it does for every array it makes. On the H200 the paged-decode kernel took
25-30 us a call, whatever its work, while it read a 4-byte context length computed in every layer and a 4-byte
scale (now a compile-time constant); with this module 11 us (1B) and 21 us (8B) at the same split count
(benchmarks/RESULTS.md). One packed array of at least MIN_INTS
ints is one allocation outside that pool, written once per step; its slices and reshapes are views, not copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from ..kv.cuda_paged_attention import cuda_kernel_available

MIN_INTS = 4  # 16 bytes: more than the allocator's 8-byte small blocks


def int_views(*parts: Sequence[int] | Sequence[Sequence[int]]) -> list[mx.array]:
    """Each part (a list of ints, or a list of equal-length int lists) as an int32 array of that shape; all of them
    views of one array made from the host's values."""
    flat: list[int] = []
    spans = []
    for part in parts:
        rows = [list(row) for row in part] if part and not isinstance(part[0], int) else None
        values = [v for row in rows for v in row] if rows is not None else [int(v) for v in part]
        if rows is not None and any(len(row) != len(rows[0]) for row in rows):
            raise ValueError("int_views: the rows of a 2-D part must have equal lengths")
        shape = (len(rows), len(rows[0])) if rows is not None else (len(values),)
        spans.append((len(flat), len(values), shape))
        flat.extend(values)
    packed = mx.array(flat + [0] * max(0, MIN_INTS - len(flat)), dtype=mx.int32)
    if cuda_kernel_available():
        # One copy made by the GPU, so every layer's kernels read memory the GPU wrote. Reading the host-written
        # array itself, rope ran 1.1-1.6x and the KV scatter 1.1-1.2x slower per call on the H200.
        packed = packed + 0
    return [packed[start:start + n].reshape(shape) for start, n, shape in spans]
