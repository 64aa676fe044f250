"""Rotary embeddings on the CPU with their angles shared across layers.

Why: MLX's CPU backend runs `mx.fast.rope` as its fallback graph, about 25 ops a call (the positions, the inverse
frequencies, their cosines and sines, the rotation), and every layer computes the same angles again for its queries
and its keys: 60 calls a decode step of a 30-layer model, over a third of the step's graph. On a CPU a decode step of
a small model is mostly such per-op costs (benchmarks/RESULTS.md, "CPU: mlxcel's AVX2 kernel").

How: `prepare` swaps each RoPE module (and LongRoPE) for a subclass whose rotation takes the cosines and sines from a
small table shared by the whole process, keyed by what determines them (rotary dims, dtype, length, offset, base,
scale, frequencies), and rotates with the fallback's own arithmetic, x1 cos - x2 sin and x1 sin + x2 cos (a whole
head as x [cos, cos] + [x2, x1] [-sin, sin]: negating a product and adding it is subtracting it). The table is
`mx.fast.rope` itself applied to a unit probe (ones then zeros), which gives its cosines and sines bit for bit, so the
output is the fallback's to the bit (tests/mlxcel_core/backends/test_cpu_rope.py). Modules with equal frequencies
share one frequency array, so their angles are one entry. Only integer offsets (a dense cache: one position for the
whole batch) use the table; per-row offset arrays, traditional (interleaved) rotation and everything on a GPU keep
`mx.fast.rope`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import mlx.core as mx
import mlx.nn as nn

from ..models.rope import LongRoPE, RoPE
from .class_swaps import swap_back

TABLE_ENTRIES = 16  # (angles of the latest steps' offsets; a step's layers share one)
_table: OrderedDict[tuple, tuple[mx.array | None, mx.array, mx.array]] = OrderedDict()
_lock = threading.Lock()  # (engines of several models may run in threads)


def _angles(dims: int, dtype, length: int, offset: int, base, scale: float, periods: mx.array | None):
    """([cos, cos], [-sin, sin]), each [1, length, dims] in dtype, cos and sin as mx.fast.rope computes them."""
    key = (dims, dtype, length, offset, base, scale, None if periods is None else id(periods))
    with _lock:
        hit = _table.get(key)
        if hit is not None and hit[0] is periods:  # (the frequencies' object itself: its id is not reused while held)
            _table.move_to_end(key)
            return hit[1], hit[2]
    half = dims // 2
    probe = mx.concatenate([mx.ones((1, length, half), dtype), mx.zeros((1, length, half), dtype)], axis=-1)
    unit = mx.fast.rope(probe, dims, traditional=False, base=base, scale=scale, offset=offset, freqs=periods)
    cos, sin = unit[..., :half], unit[..., half:]
    # [cos, cos] and [-sin, sin]: a whole head rotates as x C + swap(x) S (x1 cos + x2 (-sin) is x1 cos - x2 sin)
    cos, sin = mx.concatenate([cos, cos], axis=-1), mx.concatenate([-sin, sin], axis=-1)
    with _lock:
        _table[key] = (periods, cos, sin)
        while len(_table) > TABLE_ENTRIES:
            _table.popitem(last=False)
    return cos, sin


_swaps: dict[int, mx.array] = {}


def _swap(dims: int) -> mx.array:
    """The indices of [x2, x1] in x = [x1, x2]."""
    if dims not in _swaps:
        half = dims // 2
        _swaps[dims] = mx.concatenate([mx.arange(half, dims), mx.arange(0, half)]).astype(mx.uint32)
    return _swaps[dims]


class SharedAngles:
    def _rotate(self, x: mx.array, offset, periods: mx.array | None) -> mx.array:
        if not isinstance(offset, int) or self.traditional:
            return super()._rotate(x, offset, periods)
        half = self.dims // 2
        base = self.base if periods is None else None
        cos, sin = _angles(self.dims, x.dtype, x.shape[-2], offset, base, self.scale, periods)
        if self.dims == x.shape[-1]:
            return x * cos + mx.take(x, _swap(self.dims), axis=-1) * sin
        x1, x2 = x[..., :half], x[..., half : self.dims]
        c, s = cos[..., :half], sin[..., half:]
        parts = [x1 * c - x2 * s, x1 * s + x2 * c, x[..., self.dims :]]  # (the rest passes through, as in MLX's)
        return mx.concatenate(parts, axis=-1)


class SharedAnglesRoPE(SharedAngles, RoPE):
    pass


class SharedAnglesLongRoPE(SharedAngles, LongRoPE):
    pass


SWAPS = {RoPE: SharedAnglesRoPE, LongRoPE: SharedAnglesLongRoPE}


def applies() -> bool:
    """Whether this process computes on the CPU (where mx.fast.rope is its fallback graph)."""
    return mx.default_device() == mx.cpu


def prepare(model: nn.Module) -> int:
    """Swap the model's RoPE modules for their shared-angle classes, equal frequencies made one array; returns how
    many."""
    canonical: dict[tuple, mx.array] = {}
    swapped = 0
    for _, module in model.named_modules():
        if type(module) not in SWAPS:
            continue
        for name in ("_periods", "_long_periods"):
            periods = getattr(module, name, None)
            if periods is not None:
                key = (name, periods.dtype, tuple(periods.shape), bytes(memoryview(periods.astype(mx.float32))))
                setattr(module, name, canonical.setdefault(key, periods))
        module.__class__ = SWAPS[type(module)]
        swapped += 1
    return swapped


def unprepare(model: nn.Module) -> int:
    """Undo `prepare`'s class swaps; returns how many."""
    return swap_back(model, SWAPS)
