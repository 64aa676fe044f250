"""What the fused q/k/v launch needs to apply RoPE to q and k itself (fused_projections.py, the kernels' "_rope"
modes): the inverse frequencies of a RoPE module and each row's position.

Both are made so that a decode step computes them at most once: the frequencies once per RoPE module (an evaluated
constant, which a compiled step holds as such), the positions once per step (every layer passes the same offset
array). backends/cuda/graph_decode.py reads a recorded step's positions back with `last_positions`.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxcel_core.models.rope import RoPE

from ..small_arrays import MIN_ELEMENTS, float32_bits


def fold_frequencies(rope: nn.Module, head_dim: int) -> mx.array | None:
    """The float32 inverse frequencies [head_dim / 2] with which a kernel can apply `rope` itself, or None for a RoPE
    it cannot: only the plain class (not LongRoPE), non-traditional, over the whole head, without an attention
    factor. Made once per module."""
    if type(rope) is not RoPE or rope.traditional or rope.dims != head_dim or rope.mscale != 1.0:
        return None
    cached = getattr(rope, "_fold_inv_freq", None)
    if cached is None:
        if rope._periods is not None:
            # contiguous: MLX did not count this result as row contiguous and copied it before each launch that
            # read it in op-by-op steps (benchmarks/graph_replay.py); a replayed graph reads it where it is
            cached = mx.contiguous((1.0 / rope._periods).astype(mx.float32))
        else:
            exponents = np.arange(0, rope.dims, 2, dtype=np.float64) / rope.dims
            cached = mx.array((rope.base**-exponents).astype(np.float32))
        # Evaluated now (allowed inside a compile trace: it depends on no input), so a compiled decode step holds it as
        # a constant; left lazy, every step recomputed it, one launch per layer.
        mx.eval(cached)
        rope._fold_inv_freq = cached
    return cached


_last_positions: tuple | None = None  # (offset array, (batch, length, scale), positions): fold_positions' memo


@functools.lru_cache(maxsize=64)
def _ramp(n: int) -> mx.array:
    """0, 1, ..., n - 1 as float32, evaluated once: a compiled decode step holds it as a constant instead of running
    an arange each step (as fold_frequencies does for the frequencies)."""
    ramp = mx.arange(n, dtype=mx.float32)
    mx.eval(ramp)
    return ramp


def last_positions(offset: mx.array) -> tuple[mx.array, float] | None:
    """(positions, scale) that `fold_positions` last made from `offset` (this very array), or None."""
    if _last_positions is not None and _last_positions[0] is offset:
        return _last_positions[2], _last_positions[1][2]
    return None


def fold_positions(offset: int | mx.array, batch: int, length: int, scale: float) -> mx.array:
    """Each row's RoPE position times `scale` (what mx.fast.rope multiplies the frequencies by), float32
    [batch * length] in row-major order: offset is the cache's (an int, or an array of one or `batch` entries).

    Every layer of a decode step passes the same offset array (its cache views share it), so the result for the last
    array seen is kept and returned again: one computation a step, not one a layer. The memo holds the array itself,
    so an identity match is the same array, never a reused id. An int offset's positions are made on the host; an
    array's by one launch of our kernel where it runs (`_positions_kernel`), else by MLX ops. Either way the result is
    a view of an array of at least MIN_ELEMENTS values: a one-token step's positions would otherwise be a 4-8 byte
    array, which a kernel reading it stalls on (small_arrays.py)."""
    global _last_positions
    key = (batch, length, scale)
    if not isinstance(offset, int) and _last_positions is not None:
        last, last_key, positions = _last_positions
        if last is offset and last_key == key:
            return positions
    if isinstance(offset, int):
        return _host_positions(offset, batch, length, scale)
    if _positions_kernel_runs(offset):
        positions = _kernel_positions(offset, batch, length, scale)
    else:
        positions = _op_positions(offset, batch, length, scale)
    _last_positions = (offset, key, positions)
    return positions


def _host_positions(offset: int, batch: int, length: int, scale: float) -> mx.array:
    """(offset + t) * scale in float32 for t < length, for every row, padded: no op in the step's graph."""
    rows = (np.float32(offset) + np.arange(length, dtype=np.float32)) * np.float32(scale)
    values = np.tile(rows, batch)
    padded = np.zeros(max(values.size, MIN_ELEMENTS), dtype=np.float32)
    padded[: values.size] = values
    return mx.array(padded)[: values.size]


def _op_positions(offset: mx.array, batch: int, length: int, scale: float) -> mx.array:
    """The same values by MLX ops (a device without our kernels): one fused elementwise graph."""
    start = offset.astype(mx.float32)
    if length == 1:  # a decode step: [rows, batch], row 0 is every row's position
        rows = -(-MIN_ELEMENTS // batch)
        start = mx.broadcast_to(start.reshape(1, -1), (1, batch))
        return ((start + _ramp(rows)[:, None]) * scale)[0, :]  # (a slice: MLX makes a bare [0] a gather)
    # [batch, rows], the first `length` columns (all of them unless batch is 1 and length < MIN_ELEMENTS)
    rows = max(length, -(-MIN_ELEMENTS // batch))
    start = mx.broadcast_to(start.reshape(-1, 1), (batch, 1))
    return ((start + _ramp(rows)[None]) * scale)[:, :length].reshape(-1)


# positions[i] for i = b * steps + t is (offset[b] + t) * SCALE (offset[0] for every row where one offset is shared;
# the entries past batch * steps are padding). The sum and the product are float32 and rounded one at a time, as the
# ops' elementwise graph computes them. A decode step's (steps = 1) reads no ramp: a replayed CUDA graph
# (graph_decode.py) may read only the model's arrays, the step's ints and its launches' outputs.
_POSITIONS_SOURCE = """
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const int last = offset_shape[0] - 1;
    const float scale = __int_as_float(SCALE_BITS);
#if RAMP
    const int steps = ramp_shape[0];
    const int b = i / steps;
    const float t = ramp[i % steps];
#else
    const int b = i;
    const float t = 0.0f;
#endif
    positions[i] = (static_cast<float>(offset[b < last ? b : last]) + t) * scale;
"""
_positions_kernels: dict[bool, object] = {}


def _positions_kernel_runs(offset: mx.array) -> bool:
    from ..paged_attention import cuda_kernel_available

    return cuda_kernel_available() and mx.default_device() == mx.gpu and offset.dtype in (mx.int32, mx.uint32)


def _kernel_positions(offset: mx.array, batch: int, length: int, scale: float) -> mx.array:
    ramp = length > 1
    if ramp not in _positions_kernels:
        from .cubin_cache import cuda_kernel

        _positions_kernels[ramp] = cuda_kernel(
            name="mlxcel_rope_positions" + ("_ramp" if ramp else ""),
            input_names=["offset", "ramp"] if ramp else ["offset"],
            output_names=["positions"],
            source=f"#define RAMP {int(ramp)}\n" + _POSITIONS_SOURCE,
        )
    size = max(batch * length, MIN_ELEMENTS)
    threads = 1 << min(8, (size & -size).bit_length() - 1)  # a power of two dividing size: no thread past the end
    inputs = [offset.reshape(-1)] + ([_ramp(length)] if ramp else [])
    (positions,) = _positions_kernels[ramp](
        inputs=inputs,
        template=[("SCALE_BITS", float32_bits(scale))],
        grid=(size, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(size,)],
        output_dtypes=[mx.float32],
    )
    return positions[: batch * length]
