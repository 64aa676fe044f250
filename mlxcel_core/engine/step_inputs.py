"""A step's integer inputs (positions, slots, context lengths, block tables) as views of ONE host-built array.

Why: one host-to-device array a step instead of five, and none of them tiny: a kernel reading an array of <= 8
bytes (a batch-1 step's position, slot or context length) stalls on CUDA (backends/cuda/small_arrays.py). One packed
array of at least MIN_INTS ints is one allocation outside MLX's small-block pool, written once per step; its slices
and reshapes are views, not copies. The backend places it (Backend.own_step_inputs).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from .. import backends

MIN_INTS = 4  # 16 bytes: more than MLX's CUDA allocator's 8-byte small blocks


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
    packed = backends.current().own_step_inputs(mx.array(flat, dtype=mx.int32))
    return [packed[start : start + n].reshape(shape) for start, n, shape in spans]
