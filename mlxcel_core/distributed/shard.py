"""Shard a built model across the ranks of an `mx.distributed` group, in place (Megatron-style TP).

Per decoder layer: q/k/v and gate/up are column-parallel (each rank keeps its slice of the output rows: its
query heads, its KV heads, its part of the intermediate dimension), o and down are row-parallel (the matching
slice of the input columns) and end with one `mx.distributed.all_sum`. A MoE block shards every expert along
its intermediate dimension (gate/up rows, down columns; the router is replicated) and all-sums the block's
output once. Norms, embeddings and the LM head are replicated, so every rank computes the same logits.

`shard_model` runs inside `build_model` after the layer types are final (quantized or not) and before the
weights are loaded: it slices the model's (still lazy) parameters and the checkpoint's arrays the same way,
so only each rank's slices are ever evaluated and kept.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..errors import UnsupportedModelError
from ..models import granite, ministral3
from ..models.moe import SparseMoeBlock
from ..models.transformer import Attention, DecoderLayer, GatedMLP, TransformerLM
from .group import said_by_rank_0

_PARAMS = ("weight", "scales", "biases", "bias")
# Decoder layers and attentions that shard as the stock ones do. Granite's layer multiplies each block's whole
# output (after the row-parallel sum) by its residual multiplier before the residual add; Ministral 3's attention
# scales each query by its position alone, whichever heads a rank holds.
SHARDABLE_LAYERS = (DecoderLayer, granite.DecoderLayer)
SHARDABLE_ATTENTION = (Attention, ministral3.Ministral3Attention)


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


class ShardedMoeBlock(SparseMoeBlock):
    """Every rank routes identically (replicated router) and runs its slice of each selected expert."""

    group: mx.distributed.Group

    def __call__(self, x: mx.array, residual: mx.array | None = None, norm: nn.Module | None = None) -> mx.array:
        y = mx.distributed.all_sum(
            super().__call__(x, norm=norm), group=self.group
        )  # the residual is added once, after
        return y if residual is None else residual + y


def check_shardable(model: nn.Module, size: int) -> None:
    """Raise UnsupportedModelError (a one-line reason) unless `model` splits evenly over `size` ranks. Every rank
    builds the same model and raises the same reason: rank 0 alone prints it (group.said_by_rank_0)."""
    try:
        _check_shardable(model, size)
    except UnsupportedModelError as exc:
        said_by_rank_0(str(exc))
        raise


def _check_shardable(model: nn.Module, size: int) -> None:
    model_type = getattr(model, "model_type", type(model).__name__)
    if not isinstance(model, TransformerLM):
        raise UnsupportedModelError(f"tensor parallelism does not support {model_type} models yet")
    for layer in model.layers:
        if type(layer) not in SHARDABLE_LAYERS or type(layer.self_attn) not in SHARDABLE_ATTENTION:
            raise UnsupportedModelError(
                f"tensor parallelism does not support {model_type} models yet "
                "(supported: Llama, Mistral, Qwen2, Qwen3, Mixtral, SmolLM3, Granite, Ministral 3)"
            )
        mlp = layer[layer.mlp_name]
        if type(mlp) not in (GatedMLP, SparseMoeBlock):
            raise UnsupportedModelError(
                f"tensor parallelism does not support the {type(mlp).__name__} feed-forward block of {model_type} yet"
            )
        attn = layer.self_attn
        if attn.n_heads % size or attn.n_kv_heads % size:
            raise UnsupportedModelError(
                f"--tp-size {size} must divide the attention heads evenly: this {model_type} model has "
                f"{attn.n_heads} query heads and {attn.n_kv_heads} KV heads"
            )


def shard_model(model: nn.Module, weights: dict[str, mx.array], group: mx.distributed.Group) -> dict[str, mx.array]:
    """Shard `model` in place for `group` and return the checkpoint arrays sliced to match (same names)."""
    check_shardable(model, group.size())
    weights = dict(weights)
    for i, layer in enumerate(model.layers):
        shard_layer(layer, f"model.layers.{i}", weights, group)
    return weights


def shard_layer(layer: DecoderLayer, prefix: str, weights: dict[str, mx.array], group: mx.distributed.Group) -> None:
    """Shard one decoder layer in place (and its checkpoint arrays in `weights`, named under `prefix`).
    The model must have passed `check_shardable`."""
    size, rank = group.size(), group.rank()
    attn = layer.self_attn
    for name in ("q_proj", "k_proj", "v_proj"):
        _slice_module(attn[name], f"{prefix}.self_attn.{name}", weights, "out", rank, size)
    _slice_module(attn.o_proj, f"{prefix}.self_attn.o_proj", weights, "in", rank, size)
    _row_parallel(attn.o_proj, group)
    attn.n_heads //= size
    attn.n_kv_heads //= size
    mlp = layer[layer.mlp_name]
    base = f"{prefix}.{layer.mlp_name}"
    if isinstance(mlp, GatedMLP):
        _slice_module(mlp.gate_proj, f"{base}.gate_proj", weights, "out", rank, size)
        _slice_module(mlp.up_proj, f"{base}.up_proj", weights, "out", rank, size)
        _slice_module(mlp.down_proj, f"{base}.down_proj", weights, "in", rank, size)
        _row_parallel(mlp.down_proj, group)
    else:
        experts = mlp.switch_mlp
        if "bias" in experts.down_proj:
            raise UnsupportedModelError("tensor parallelism does not support MoE experts with a down_proj bias")
        _slice_module(experts.gate_proj, f"{base}.switch_mlp.gate_proj", weights, "out", rank, size)
        _slice_module(experts.up_proj, f"{base}.switch_mlp.up_proj", weights, "out", rank, size)
        _slice_module(experts.down_proj, f"{base}.switch_mlp.down_proj", weights, "in", rank, size)
        mlp.__class__ = ShardedMoeBlock
        mlp.group = group


def _row_parallel(module: nn.Module, group) -> None:
    if type(module) is nn.Linear:
        module.__class__ = RowParallelLinear
    elif type(module) is nn.QuantizedLinear:
        module.__class__ = RowParallelQuantizedLinear
    else:
        raise UnsupportedModelError(f"tensor parallelism cannot shard a {type(module).__name__} layer")
    module.group = group


def _slice_module(module: nn.Module, path: str, weights: dict[str, mx.array], kind: str, rank: int, size: int) -> None:
    """Column-parallel ("out": output rows, and the bias) or row-parallel ("in": input columns; packed
    quantized columns and their group scales together, the bias stays whole) slice of one layer."""
    for name in _PARAMS:
        if name not in module:
            continue
        if name == "bias":
            if kind == "in":
                continue
            axis = -1
        else:
            axis = -2 if kind == "out" else -1
        module[name] = _slice(module[name], axis, rank, size, path)
        key = f"{path}.{name}"
        if key in weights:  # a missing one is reported by the loader's name check
            weights[key] = _slice(weights[key], axis, rank, size, path)


def _slice(a: mx.array, axis: int, rank: int, size: int, path: str) -> mx.array:
    """This rank's part of `a` along `axis`. `a` may be a loading/sliced.py handle: its slice is another handle,
    so that only the slice's bytes are read later."""
    axis %= a.ndim
    n = a.shape[axis]
    if n % size:
        raise UnsupportedModelError(
            f"--tp-size {size} does not divide {path} ({n} along axis {axis}; "
            "a quantized layer needs whole quantization groups per rank)"
        )
    step = n // size
    index = (slice(None),) * axis + (slice(rank * step, (rank + 1) * step),)
    part = a[index]
    # A slice is a view that keeps the whole tensor alive (every rank would hold the full model), and MLX's
    # CUDA quantized_matmul has no kernel for a strided (column-sliced) weight: copy the slice out.
    return mx.contiguous(part) if isinstance(part, mx.array) else part
