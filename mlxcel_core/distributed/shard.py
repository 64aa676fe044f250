"""Shard a built model across the ranks of an `mx.distributed` group, in place (Megatron-style TP).

Per decoder layer: q/k/v and gate/up are column-parallel (each rank keeps its slice of the output rows: its
query heads, its KV heads, its part of the intermediate dimension), o and down are row-parallel (the matching
slice of the input columns) and end with one `mx.distributed.all_sum` (distributed/parallel_layers.py). A block of
experts (routed, and shared where the family has them) shards every expert along its intermediate dimension
(gate/up rows, down columns; the router is replicated) and all-sums the block's output once; a per-expert down bias
is added on rank 0 only. Norms, embeddings and the LM head are replicated, so every rank computes the same logits.

What the families add: attention sinks (gpt-oss) are per query head, so each rank keeps its heads'; OLMo 3's q/k
norms span every head, so they become `SplitRMSNorm`s; a latent attention (DeepSeek-V3, MLA) shards its query heads
and their per-head up-projections (`embed_q`, `unembed_out`) while every rank computes and caches the one shared
latent key. Gemma 4's experts beside the MLP are normed after their sum, so that block sums before its norm; its
KV-shared layers have no k/v projections and read the same heads of their source layer's cache on each rank.
Phi-3's fused projections (q, k and v in one; gate and up in one) give each rank its slice of every part.

`shard_model` runs inside `build_model` after the layer types are final (quantized or not) and before the
weights are loaded: it slices the model's (still lazy) parameters and the checkpoint's arrays the same way,
so only each rank's slices are ever evaluated and kept. A family whose `sanitize` reshapes tensors (fused expert
banks, MXFP4 repacking, DeepSeek's kv_b split) gets arrays instead of unread handles (`sanitize_reads_handles`):
each rank then reads such a checkpoint's tensors whole and keeps its slices.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..errors import UnsupportedModelError
from ..models import deepseek_v3, gemma4, gemma_common, gpt_oss, granite, llama4, ministral3, olmo3, phi3
from ..models.gemma4_layers import Gemma4Attention, Gemma4DecoderLayer
from ..models.grouped_moe import GroupedMoeBlock
from ..models.moe import SparseMoeBlock, SwitchGLU
from ..models.transformer import Attention, DecoderLayer, GatedMLP, TransformerLM
from .group import said_by_rank_0
from .parallel_layers import (  # noqa: F401  (RowParallel*: the classes a sharded model's layers take)
    RowParallelLinear,
    RowParallelQuantizedLinear,
    SplitRMSNorm,
    row_parallel_class,
    summed_class,
)

_PARAMS = ("weight", "scales", "biases", "bias")
# Decoder layers that shard as the stock one does. Granite's multiplies each block's whole output (after the
# row-parallel sum) by its residual multiplier before the residual add; OLMo 3's and the Gemmas' norm each block's
# whole output; Gemma 4's per-layer input gate and projection are replicated.
SHARDABLE_LAYERS = (
    DecoderLayer,
    granite.DecoderLayer,
    olmo3.Olmo3DecoderLayer,
    gemma_common.DecoderLayer,
    Gemma4DecoderLayer,
)
# Attentions sharded by query and KV heads: Ministral 3 scales each query by its position alone and Llama 4 by its
# position's temperature, and Llama 4's L2 q/k norm is per head, whichever heads a rank holds. Gemma 4's KV-shared
# layers have no k/v projections: they read their source layer's cache, which holds the same heads on each rank.
HEAD_ATTENTION = (
    Attention,
    ministral3.Ministral3Attention,
    llama4.Llama4Attention,
    olmo3.Olmo3Attention,
    Gemma4Attention,
    phi3.FusedAttention,
)
LATENT_ATTENTION = (deepseek_v3.LatentAttention,)
# Feed-forward blocks of experts: their SwitchGLU and GatedMLP children are sliced, the rest (routers) replicated.
EXPERT_BLOCKS = (SparseMoeBlock, GroupedMoeBlock, llama4.Llama4MoE, gpt_oss.SparseMoeBlock)
# Families that get arrays, not unread handles: their sanitize reshapes tensors, or (Phi-3) their fused projections
# are sliced part by part and joined.
WHOLE_TENSORS = (llama4.Model, gpt_oss.Model, deepseek_v3.Model, gemma4.Model, phi3.Model)
SUPPORTED = (
    "Llama, Mistral, Qwen2, Qwen3, Mixtral, SmolLM3, Granite, Ministral 3, OLMo 3, GLM-4.5, gpt-oss, Llama 4, "
    "DeepSeek-V3, Gemma 2, Gemma 3, Gemma 4, Phi-3"
)


def check_shardable(model: nn.Module, size: int) -> None:
    """Raise UnsupportedModelError (a one-line reason) unless `model` splits evenly over `size` ranks. Every rank
    builds the same model and raises the same reason: rank 0 alone prints it (group.said_by_rank_0)."""
    try:
        _check_shardable(model, size)
    except UnsupportedModelError as exc:
        said_by_rank_0(str(exc))
        raise


def sanitize_reads_handles(model: nn.Module) -> bool:
    """Whether the model's `sanitize` takes loading/sliced.py handles (renames, drops, stacks and plain slices
    only); False: hand it arrays."""
    return not isinstance(model, WHOLE_TENSORS)


def _check_shardable(model: nn.Module, size: int) -> None:
    model_type = getattr(model, "model_type", type(model).__name__)
    if not isinstance(model, (TransformerLM, gemma4.Model)):
        raise UnsupportedModelError(f"tensor parallelism does not support {model_type} models yet")
    for layer in model.layers:
        attn = getattr(layer, "self_attn", None)
        if type(layer) not in SHARDABLE_LAYERS or type(attn) not in HEAD_ATTENTION + LATENT_ATTENTION:
            raise UnsupportedModelError(
                f"tensor parallelism does not support {model_type} models yet (supported: {SUPPORTED})"
            )
        mlp = layer[_mlp_name(layer)]
        if type(mlp) not in (GatedMLP, phi3.MLP) and type(mlp) not in EXPERT_BLOCKS:
            raise UnsupportedModelError(
                f"tensor parallelism does not support the {type(mlp).__name__} feed-forward block of {model_type} yet"
            )
        if isinstance(attn, LATENT_ATTENTION):
            if attn.n_heads % size:
                raise UnsupportedModelError(
                    f"--tp-size {size} must divide the attention heads evenly: this {model_type} model has "
                    f"{attn.n_heads} query heads (over one shared latent key)"
                )
        elif attn.n_heads % size or attn.n_kv_heads % size:
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
    attn, at = layer.self_attn, f"{prefix}.self_attn"
    if isinstance(attn, LATENT_ATTENTION):
        _shard_latent_attention(attn, at, weights, group)
    else:
        _shard_head_attention(attn, at, weights, group)
    mlp, base = layer[_mlp_name(layer)], f"{prefix}.{_mlp_name(layer)}"
    if type(mlp) is GatedMLP:
        _slice_mlp(mlp, base, weights, group)
        _row_parallel(mlp.down_proj, group)
    elif type(mlp) is phi3.MLP:  # gate and up side by side in one projection: each rank's slice of both
        half = mlp.gate_up_proj.weight.shape[-2] // 2
        _slice_fused(mlp.gate_up_proj, f"{base}.gate_up_proj", weights, [half, half], group)
        _slice_module(mlp.down_proj, f"{base}.down_proj", weights, "in", group.rank(), group.size())
        _row_parallel(mlp.down_proj, group)
    else:
        _shard_experts(mlp, base, weights, group)
    if isinstance(layer, Gemma4DecoderLayer) and layer.moe:  # experts beside the MLP, normed after their sum
        _shard_experts(layer.experts, f"{prefix}.experts", weights, group, takes_residual=False)


def _mlp_name(layer: nn.Module) -> str:
    return getattr(layer, "mlp_name", "mlp")


def _shard_head_attention(attn: Attention, at: str, weights: dict, group) -> None:
    size, rank = group.size(), group.rank()
    if isinstance(attn, phi3.FusedAttention):  # q, k and v side by side in one projection
        _slice_fused(attn.qkv_proj, f"{at}.qkv_proj", weights, [attn.q_size, attn.kv_size, attn.kv_size], group)
        attn.q_size //= size
        attn.kv_size //= size
    for name in ("q_proj", "k_proj", "v_proj"):
        if name in attn:  # (Gemma 4: no k/v on a KV-shared layer, no v where values are the keys)
            _slice_module(attn[name], f"{at}.{name}", weights, "out", rank, size)
    _slice_module(attn.o_proj, f"{at}.o_proj", weights, "in", rank, size)
    _row_parallel(attn.o_proj, group)
    if "sinks" in attn:  # one logit per query head
        _slice_param(attn, "sinks", f"{at}.sinks", weights, 0, rank, size)
    if isinstance(attn, olmo3.Olmo3Attention):  # norms over all heads' q (k): each rank holds its heads' part
        for name in ("q_norm", "k_norm"):
            norm = attn[name]
            dims = norm.weight.shape[-1]
            _slice_param(norm, "weight", f"{at}.{name}.weight", weights, 0, rank, size)
            norm.__class__ = SplitRMSNorm
            norm.group, norm.dims = group, dims
    attn.n_heads //= size
    attn.n_kv_heads //= size


def _shard_latent_attention(attn: deepseek_v3.LatentAttention, at: str, weights: dict, group) -> None:
    """Query heads and their per-head maps sliced; the latent key's projection and norm replicated."""
    size, rank = group.size(), group.rank()
    q = "q_proj" if attn.q_lora_rank is None else "q_b_proj"
    _slice_module(attn[q], f"{at}.{q}", weights, "out", rank, size)
    for name in ("embed_q", "unembed_out"):  # [heads, out, in]
        _slice_module(attn[name], f"{at}.{name}", weights, "heads", rank, size)
    _slice_module(attn.o_proj, f"{at}.o_proj", weights, "in", rank, size)
    _row_parallel(attn.o_proj, group)
    attn.n_heads //= size


def _slice_fused(module: nn.Module, path: str, weights: dict, parts: list[int], group) -> None:
    """Column-parallel slice of a projection whose output rows are `parts` side by side (Phi-3's qkv_proj and
    gate_up_proj): this rank's slice of each part, joined in the same order."""
    for name in _PARAMS:
        if name in module:
            axis = -1 if name == "bias" else -2
            _slice_param(module, name, f"{path}.{name}", weights, axis, group.rank(), group.size(), parts)


def _slice_parts(a: mx.array, axis: int, parts: list[int], rank: int, size: int, path: str) -> mx.array:
    bounds = [sum(parts[:i]) for i in range(1, len(parts))]
    pieces = mx.split(a, bounds, axis=axis)
    return mx.concatenate([_slice(piece, axis, rank, size, path) for piece in pieces], axis=axis)


def _slice_mlp(mlp: nn.Module, base: str, weights: dict, group) -> None:
    """gate/up rows and down columns of a GatedMLP or a SwitchGLU (every expert's)."""
    size, rank = group.size(), group.rank()
    for name, kind in (("gate_proj", "out"), ("up_proj", "out"), ("down_proj", "in")):
        _slice_module(mlp[name], f"{base}.{name}", weights, kind, rank, size)


def _shard_experts(block: nn.Module, base: str, weights: dict, group, takes_residual: bool = True) -> None:
    """Every expert bank and shared expert of the block sliced; the block's output all-summed once
    (parallel_layers.summed_class)."""
    for name, child in block.children().items():
        if not (isinstance(child, SwitchGLU) or type(child) is GatedMLP):
            continue  # a router: replicated
        _slice_mlp(child, f"{base}.{name}", weights, group)
        down = child.down_proj
        if "bias" in down and group.rank():  # the whole bias, added by rank 0 alone (the sum adds every rank's)
            down["bias"] = mx.zeros(down["bias"].shape, down["bias"].dtype)
            key = f"{base}.{name}.down_proj.bias"
            if key in weights:
                weights[key] = mx.zeros(weights[key].shape, weights[key].dtype)
    block.__class__ = summed_class(type(block), takes_residual)
    block.group = group


def _row_parallel(module: nn.Module, group) -> None:
    cls = row_parallel_class(module)
    if cls is None:
        raise UnsupportedModelError(f"tensor parallelism cannot shard a {type(module).__name__} layer")
    module.__class__ = cls
    module.group = group


def _slice_module(module: nn.Module, path: str, weights: dict[str, mx.array], kind: str, rank: int, size: int) -> None:
    """Column-parallel ("out": output rows, and the bias) or row-parallel ("in": input columns; packed
    quantized columns and their group scales together, the bias stays whole) slice of one layer; "heads": the
    leading (per-head) axis of every parameter."""
    for name in _PARAMS:
        if name not in module:
            continue
        if kind == "heads":
            axis = 0
        elif name == "bias":
            if kind == "in":
                continue
            axis = -1
        else:
            axis = -2 if kind == "out" else -1
        _slice_param(module, name, f"{path}.{name}", weights, axis, rank, size)


def _slice_param(
    module: nn.Module,
    name: str,
    key: str,
    weights: dict,
    axis: int,
    rank: int,
    size: int,
    parts: list[int] | None = None,
) -> None:
    """This rank's part of `module[name]` and of the checkpoint's `weights[key]` (a missing one is reported by
    the loader's name check); `parts`: the axis holds these parts side by side, each sliced (`_slice_parts`)."""
    path = key.rsplit(".", 1)[0]

    def cut(a):
        return _slice(a, axis, rank, size, path) if parts is None else _slice_parts(a, axis, parts, rank, size, path)

    module[name] = cut(module[name])
    if key in weights:
        weights[key] = cut(weights[key])


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
