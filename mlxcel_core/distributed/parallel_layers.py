"""The layers a sharded model computes with (distributed/shard.py swaps them in by `__class__`).

- Row-parallel projections: each rank multiplies its slice of the input columns, one `all_sum` gives the whole
  product, and the (whole, unsharded) bias is added once after it.
- Summed blocks: a feed-forward block whose experts (routed and shared) each hold a slice of their intermediate
  dimension computes a partial output on every rank; one `all_sum` of the block's output makes it whole, and the
  residual is added once, after it. Routers are replicated, so every rank chooses the same experts.
- `SplitRMSNorm`: an RMSNorm over a vector whose parts lie on different ranks (OLMo 3 norms the whole q and k
  projections, all heads at once): the sum of squares is summed over the ranks before each rank scales its part.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


class RowParallelLinear(nn.Linear):
    """x @ W_rank.T summed over ranks, then the (whole, unsharded) bias once."""

    group: mx.distributed.Group

    def __call__(self, x: mx.array) -> mx.array:
        y = mx.distributed.all_sum(x @ self["weight"].T, group=self.group)
        return y + self["bias"] if "bias" in self else y


class RowParallelQuantizedLinear(nn.QuantizedLinear):
    group: mx.distributed.Group

    def __call__(self, x: mx.array) -> mx.array:
        y = mx.quantized_matmul(
            x,
            self["weight"],
            scales=self["scales"],
            biases=self.get("biases"),
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )
        y = mx.distributed.all_sum(y, group=self.group)
        return y + self["bias"] if "bias" in self else y


def row_parallel_class(module: nn.Module) -> type | None:
    """The row-parallel class of a plain (or quantized) Linear; None for any other layer."""
    return {nn.Linear: RowParallelLinear, nn.QuantizedLinear: RowParallelQuantizedLinear}.get(type(module))


_SUMMED: dict[tuple[type, bool], type] = {}


def summed_class(block_class: type, takes_residual: bool = True) -> type:
    """A subclass of the feed-forward block class whose output is all-summed over the ranks; `takes_residual`: the
    block takes DecoderLayer's `residual=` and `norm=`, and the residual is added once, after the sum (otherwise
    every argument is passed through). One subclass per block class, so `isinstance` checks and names still see
    the block."""
    key = (block_class, takes_residual)
    if key not in _SUMMED:
        if takes_residual:

            def __call__(self, x: mx.array, residual: mx.array | None = None, norm: nn.Module | None = None):
                y = mx.distributed.all_sum(block_class.__call__(self, x, norm=norm), group=self.group)
                return y if residual is None else residual + y

        else:

            def __call__(self, *args, **kwargs):
                return mx.distributed.all_sum(block_class.__call__(self, *args, **kwargs), group=self.group)

        _SUMMED[key] = type(f"Summed{block_class.__name__}", (block_class,), {"__call__": __call__})
    return _SUMMED[key]


class SplitRMSNorm(nn.RMSNorm):
    """RMSNorm over `dims` features of which this rank holds a slice (and the weight's matching slice): the mean
    square is the ranks' summed squares over `dims`. Computed in float32 and rounded before the weight is applied,
    as mx.fast.rms_norm does."""

    group: mx.distributed.Group
    dims: int

    def __call__(self, x: mx.array) -> mx.array:
        x32 = x.astype(mx.float32)
        squares = mx.distributed.all_sum((x32 * x32).sum(axis=-1, keepdims=True), group=self.group)
        return (x32 * mx.rsqrt(squares / self.dims + self.eps)).astype(x.dtype) * self["weight"]
