"""A step's integer inputs (positions, slots, context lengths, block tables) as views of ONE host-built array.

Why: a kernel reading an array of <= 8 bytes (a batch-1 step's position, slot or context length) stalls on CUDA
(cuda_small_arrays.py; on the H200 the paged-decode kernel took 25-30 us a call with them, 11 us (1B) and 21 us (8B)
at the same split count with this module, benchmarks/RESULTS.md). One packed array of at least MIN_INTS ints is one
allocation outside MLX's small-block pool, written once per step; its slices and reshapes are views, not copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from ..cuda_small_arrays import MIN_ELEMENTS
from ..kv.cuda_paged_attention import cuda_kernel_available

MIN_INTS = MIN_ELEMENTS  # 16 bytes: more than the allocator's 8-byte small blocks


def packed_ints(*parts: Sequence[int] | Sequence[Sequence[int]]) -> tuple[list[int], list[tuple]]:
    """The parts (each a list of ints, or a list of equal-length int lists) as one flat list, padded to MIN_INTS,
    and each part's (start, length, shape) in it."""
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
    return flat + [0] * max(0, MIN_INTS - len(flat)), spans


def int_views(*parts: Sequence[int] | Sequence[Sequence[int]]) -> list[mx.array]:
    """Each part (a list of ints, or a list of equal-length int lists) as an int32 array of that shape; all of them
    views of one array made from the host's values (`packed_ints`)."""
    flat, spans = packed_ints(*parts)
    packed = mx.array(flat, dtype=mx.int32)
    if cuda_kernel_available():
        # One copy made by the GPU, so every layer's kernels read memory the GPU wrote. Reading the host-written
        # array itself, rope ran 1.1-1.6x and the KV scatter 1.1-1.2x slower per call on the H200.
        packed = packed + 0
    return [packed[start:start + n].reshape(shape) for start, n, shape in spans]
