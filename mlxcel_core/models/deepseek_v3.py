"""DeepSeek-V3 / V3.1, Kimi-K2, Moonlight (model_type deepseek_v3). Definition follows transformers'
DeepseekV3ForCausalLM (modeling_deepseek_v3.py, configuration_deepseek_v3.py).

Attention is multi-head latent attention (MLA, DeepseekV3Attention): queries come from `q_proj`, or (`q_lora_rank`
set) from q_b_proj(q_a_layernorm(q_a_proj(x))), and split per head into a NoPE part (qk_nope_head_dim) and a RoPE
part (qk_rope_head_dim). `kv_a_proj_with_mqa` makes one latent per token: c_kv (kv_lora_rank, then kv_a_layernorm)
and one rotated key part k_pe shared by every head. transformers expands the latent with `kv_b_proj` into per-head
keys (k_nope, k_pe) and values; here the expansion is absorbed into the queries and the output instead (DeepSeek's
own inference does the same), which is the same maths: per head, q_nope . (W_UK c_kv) = (q_nope W_UK) . c_kv, and
the attention-weighted sum of W_UV c_kv is W_UV applied to the weighted sum of c_kv. So attention is multi-query
attention over the latent: queries [B, H, L, kv_lora_rank + rope] = (q_nope W_UK, q_pe), one key head
(c_kv, k_pe), and the values are the keys' first kv_lora_rank dims (`values_in_keys`: the caches store the key only,
kv_lora_rank + qk_rope_head_dim numbers per token and layer). The output [B, H, L, kv_lora_rank] goes through W_UV
per head, then o_proj. W_UK and W_UV are kv_b_proj's rows, held per head as `embed_q` and `unembed_out` (mlx-lm's
names and layout, so mlx-lm's converted checkpoints load as they are); `sanitize` splits a checkpoint's kv_b_proj.

RoPE turns only the qk_rope_head_dim part. `rope_interleave` (default true) rotates interleaved pairs (x0, x1),
(x2, x3), ... (transformers' apply_rotary_pos_emb_interleave, whose output is the de-interleaved layout: queries
and keys share it, so their dot products are those of MLX's `traditional` rope); false: half-split (rotate_half).
The softmax scale is (qk_nope_head_dim + qk_rope_head_dim) ** -0.5, times mscale ** 2 where a non-default RoPE
scaling has `mscale_all_dim` (yarn_get_mscale(factor, mscale_all_dim), transformers' yarn_apply_mscale); YaRN's own
attention factor (mscale / mscale_all_dim) scales cos and sin as for every family (rope.py).

The first `first_k_dense_replace` layers have a dense SwiGLU MLP; the others GroupedMoeBlock (grouped_moe.py,
DeepseekV3MoE): noaux_tc sigmoid routing with `e_score_correction_bias`, `n_group` / `topk_group`,
`norm_topk_prob`, `routed_scaling_factor`, plus `n_shared_experts` shared experts.

Checkpoints: released ones carry `num_nextn_predict_layers` multi-token-prediction layers (dropped: plain decoding
does not use them) and may be FP8 block-quantized (`quantization_config: {quant_method: fp8, weight_block_size}`,
float8_e4m3fn weights with a `weight_scale_inv` per block): dequantized at load, as transformers does without an
FP8 GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..errors import CorruptModelError, UnsupportedModelError
from .base import LayerCache, attention, cache_offset, drop_extra_layers, normed
from .grouped_moe import check_grouping, dense_or_grouped_mlp
from .moe import stack_experts
from .rope import RoPE, initialize_rope
from .transformer import DecoderLayer, TransformerArgs, TransformerLM, add_projection, heads_first, heads_last

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: DeepseekV3RMSNorm's default, not rms_norm_eps


@dataclass
class ModelArgs(TransformerArgs):
    """DeepseekV3Config's fields and defaults, plus the older keys of the Hub's checkpoints (`topk_method`,
    `scoring_func`, `moe_layer_freq`) that must say what transformers 5 computes."""

    model_type: str = "deepseek_v3"
    max_position_embeddings: int = 4096
    moe_intermediate_size: int = 2048
    n_shared_experts: int | None = 1
    n_routed_experts: int = 256
    num_local_experts: int | None = None  # DeepseekV3Config's alias of n_routed_experts
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    n_group: int = 8
    topk_group: int = 4
    num_experts_per_tok: int = 8
    first_k_dense_replace: int = 3
    norm_topk_prob: bool = True
    rope_interleave: bool = True
    attention_bias: bool = False
    topk_method: str = "noaux_tc"
    scoring_func: str = "sigmoid"
    moe_layer_freq: int = 1
    quantization_config: dict[str, Any] | None = None

    def __post_init__(self):
        self.head_dim = self.qk_rope_head_dim  # as DeepseekV3Config: the rotary embedding's size
        super().__post_init__()
        if self.num_local_experts is not None:
            self.n_routed_experts = self.num_local_experts
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.num_key_value_heads != self.num_attention_heads:
            raise UnsupportedModelError(
                f"deepseek_v3 with num_key_value_heads {self.num_key_value_heads} != num_attention_heads "
                f"{self.num_attention_heads} is not supported (every head has its own keys from kv_b_proj)"
            )
        for key, value, expected in (
            ("topk_method", self.topk_method, "noaux_tc"),
            ("scoring_func", self.scoring_func, "sigmoid"),
            ("moe_layer_freq", self.moe_layer_freq, 1),
        ):
            if value != expected:
                raise UnsupportedModelError(f"deepseek_v3 {key} {value!r} is not supported (supported: {expected!r})")
        if any(self.is_sparse(i) for i in range(self.num_hidden_layers)):
            check_grouping(self.n_routed_experts, self.num_experts_per_tok, self.n_group, self.topk_group)
        self.fp8_block = fp8_block_size(self.quantization_config)

    def is_sparse(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim ** -0.5, times mscale ** 2 (transformers' yarn_apply_mscale)."""
        scale = self.qk_head_dim**-0.5
        scaling = self.rope_scaling  # None for the default RoPE
        if scaling and scaling.get("mscale_all_dim"):
            factor = float(scaling["factor"])
            mscale = 1.0 if factor <= 1 else 0.1 * scaling["mscale_all_dim"] * math.log(factor) + 1.0
            scale = scale * mscale * mscale
        return scale


def fp8_block_size(quantization_config: dict[str, Any] | None) -> tuple[int, int] | None:
    """The FP8 weights' block (rows, columns) where config.json says the checkpoint is FP8 block-quantized; None
    where it says nothing of a method (an MLX-quantized checkpoint's own `quantization_config`); else refuse."""
    config = quantization_config or {}
    method = config.get("quant_method")
    if method is None:
        return None
    if method != "fp8":
        raise UnsupportedModelError(f"deepseek_v3 quantization_config quant_method '{method}' is not supported (fp8)")
    if config.get("fmt", "e4m3") != "e4m3" or config.get("activation_scheme", "dynamic") != "dynamic":
        raise UnsupportedModelError(
            f"deepseek_v3 fp8 checkpoints with fmt '{config.get('fmt')}' and activation_scheme "
            f"'{config.get('activation_scheme')}' are not supported (supported: e4m3, dynamic)"
        )
    rows, columns = config.get("weight_block_size") or (128, 128)
    return int(rows), int(columns)


class MultiLinear(nn.Module):
    """One linear map per head: x [..., H, L, input_dims] -> [..., H, L, output_dims]; weight [H, output, input]."""

    def __init__(self, input_dims: int, output_dims: int, num_heads: int):
        super().__init__()
        scale = math.sqrt(1.0 / input_dims)
        self.weight = mx.random.uniform(-scale, scale, (num_heads, output_dims, input_dims))

    def __call__(self, x: mx.array) -> mx.array:
        return x @ self.weight.swapaxes(-1, -2)

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine", **_):
        heads, output_dims, input_dims = self.weight.shape
        layer = QuantizedMultiLinear(input_dims, output_dims, heads, group_size, bits, mode)
        layer.weight, layer.scales, *biases = mx.quantize(self.weight, group_size, bits, mode=mode)
        if biases:
            layer.biases = biases[0]
        return layer


class QuantizedMultiLinear(nn.Module):
    """MultiLinear with packed weights and per-group scales (and biases, affine), applied with quantized_matmul."""

    def __init__(self, input_dims: int, output_dims: int, num_heads: int, group_size: int, bits: int, mode: str):
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode
        weight = mx.zeros((num_heads, output_dims, input_dims))
        self.weight, self.scales, *biases = mx.quantize(weight, group_size, bits, mode=mode)
        if biases:
            self.biases = biases[0]
        self.freeze()

    def __call__(self, x: mx.array) -> mx.array:
        return mx.quantized_matmul(
            x,
            self["weight"],
            scales=self["scales"],
            biases=self.get("biases"),
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )


class LatentAttention(nn.Module):
    """DeepseekV3Attention in the absorbed form (see the module docstring). Takes DecoderLayer's `residual`, `norm`
    and `last_only` as Attention does."""

    def __init__(self, args: ModelArgs, rope: RoPE):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.q_lora_rank = args.q_lora_rank
        self.kv_lora_rank = args.kv_lora_rank
        self.qk_nope_head_dim = args.qk_nope_head_dim
        hidden, heads, bias = args.hidden_size, args.num_attention_heads, args.attention_bias
        if args.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * args.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, args.q_lora_rank, bias=bias)
            self.q_a_layernorm = nn.RMSNorm(args.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(args.q_lora_rank, heads * args.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, args.kv_lora_rank + args.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = nn.RMSNorm(args.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.embed_q = MultiLinear(args.qk_nope_head_dim, args.kv_lora_rank, heads)  # W_UK, transposed per head
        self.unembed_out = MultiLinear(args.kv_lora_rank, args.v_head_dim, heads)  # W_UV
        self.o_proj = nn.Linear(heads * args.v_head_dim, hidden, bias=bias)
        self.rope = rope
        self.scale = args.softmax_scale

    def latent(self, x: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """(q_nope [B, H, L, nope], rotated q_pe [B, H, L, rope], latent keys [B, 1, L, kv_lora_rank + rope])."""
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = heads_first(q, self.n_heads)
        q_nope, q_pe = q[..., : self.qk_nope_head_dim], q[..., self.qk_nope_head_dim :]
        kv = self.kv_a_proj_with_mqa(x)[:, None]  # [B, 1, L, kv_lora_rank + rope]: one key head
        c_kv = self.kv_a_layernorm(kv[..., : self.kv_lora_rank])
        k_pe = self.rope(kv[..., self.kv_lora_rank :], offset)
        return q_nope, self.rope(q_pe, offset), mx.concatenate([c_kv, k_pe], axis=-1)

    def __call__(
        self,
        x: mx.array,
        cache: LayerCache | None,
        residual: mx.array | None = None,
        norm: nn.Module | None = None,
        last_only: bool = False,
    ) -> mx.array:
        q_nope, q_pe, keys = self.latent(normed(x, norm), cache_offset(cache))
        if last_only:  # one query, at the last position (every position's latent goes to the cache)
            q_nope, q_pe = q_nope[:, :, -1:], q_pe[:, :, -1:]
            residual = None if residual is None else residual[:, -1:]
        queries = mx.concatenate([self.embed_q(q_nope), q_pe], axis=-1)
        out = attention(queries, keys, None, cache, self.scale, values_in_keys=self.kv_lora_rank)
        return add_projection(self.o_proj, heads_last(self.unembed_out(out)), residual)


class Model(TransformerLM):
    def __init__(self, args: ModelArgs):
        rope = initialize_rope(
            args.qk_rope_head_dim,
            args.rope_base,
            args.rope_interleave,
            args.rope_scaling,
            max_position_embeddings=args.max_position_embeddings,
        )
        layers = [
            DecoderLayer(args, LatentAttention(args, rope), dense_or_grouped_mlp(args, i))
            for i in range(args.num_hidden_layers)
        ]
        super().__init__(args, layers)

    def kv_layout(self) -> list[tuple[int, int]]:
        """Per layer, (heads, head dim) of what its cache stores (models.base.kv_layout): one latent key of
        kv_lora_rank + qk_rope_head_dim (and no values: engine/budget.py counts the key alone)."""
        args = self.args
        return [(1, args.kv_lora_rank + args.qk_rope_head_dim)] * len(self.layers)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Dequantize FP8 blocks, drop the MTP layers (and the empty shared experts of n_shared_experts 0), stack the
        routed experts, split kv_b_proj into embed_q / unembed_out."""
        args = self.args
        if any(name.endswith(".weight_scale_inv") for name in weights):
            if args.fp8_block is None:
                raise CorruptModelError("the checkpoint holds FP8 weight_scale_inv tensors, config.json no fp8 method")
            weights = dequantize_fp8(weights, args.fp8_block)
        weights = super().sanitize(drop_extra_layers(weights, args.num_hidden_layers))
        if not args.n_shared_experts:
            weights = {k: v for k, v in weights.items() if ".mlp.shared_experts." not in k}
        for i in range(args.num_hidden_layers):
            if args.is_sparse(i):
                weights = stack_experts(weights, f"model.layers.{i}.mlp", args.n_routed_experts)
            split_kv_b(weights, f"model.layers.{i}.self_attn", args)
        return weights


def dequantize_fp8(weights: dict[str, mx.array], block: tuple[int, int]) -> dict[str, mx.array]:
    """Every `X.weight` that has an `X.weight_scale_inv` as weight * scale of its block (float8_e4m3fn values, read
    by MLX as uint8; one scale per `block` rows x columns, the last blocks of a row or column cut short), computed in
    float32 as transformers' Fp8Dequantize and DeepSeek's weight_dequant, stored in the embedding's dtype (the
    checkpoint's unquantized one)."""
    embedding = weights.get("model.embed_tokens.weight")
    dtype = embedding.dtype if embedding is not None and mx.issubdtype(embedding.dtype, mx.floating) else mx.bfloat16
    out = dict(weights)
    for name in [n for n in weights if n.endswith(".weight_scale_inv")]:
        weight_name = name[: -len("_scale_inv")]
        scale, weight = out.pop(name), out[weight_name]
        rows, columns = weight.shape[-2:]
        grid = (-(-rows // block[0]), -(-columns // block[1]))
        if tuple(scale.shape[-2:]) != grid:
            raise CorruptModelError(
                f"{name} has shape {tuple(scale.shape)}, {weight_name} {tuple(weight.shape)} in blocks of {block} "
                f"needs {grid}"
            )
        values = mx.from_fp8(weight, dtype=mx.float32) if weight.dtype == mx.uint8 else weight.astype(mx.float32)
        scales = mx.repeat(mx.repeat(scale.astype(mx.float32), block[0], axis=-2), block[1], axis=-1)
        out[weight_name] = (values * scales[..., :rows, :columns]).astype(dtype)
    return out


def split_kv_b(weights: dict[str, mx.array], prefix: str, args: ModelArgs) -> None:
    """`{prefix}.kv_b_proj.weight` [H * (nope + v), kv_lora_rank] -> `{prefix}.embed_q.weight` [H, kv_lora_rank,
    nope] (W_UK per head, transposed) and `{prefix}.unembed_out.weight` [H, v, kv_lora_rank] (W_UV), in place. A
    quantized kv_b_proj (an older mlx-lm conversion) is dequantized, split and quantized again with its bits and
    group size where a part's input dimension allows, as mlx-lm does."""
    weight = weights.pop(f"{prefix}.kv_b_proj.weight", None)
    if weight is None:
        return
    scales = weights.pop(f"{prefix}.kv_b_proj.scales", None)
    quantized = None
    if scales is not None:
        bits = weight.shape[-1] * 32 // args.kv_lora_rank
        quantized = dict(group_size=args.kv_lora_rank // scales.shape[-1], bits=bits)
        biases = weights.pop(f"{prefix}.kv_b_proj.biases")
        weight = mx.dequantize(weight, scales, biases, **quantized)
    weight = weight.reshape(args.num_attention_heads, args.qk_nope_head_dim + args.v_head_dim, args.kv_lora_rank)
    parts = {
        "embed_q": mx.contiguous(weight[:, : args.qk_nope_head_dim, :].swapaxes(-1, -2)),
        "unembed_out": mx.contiguous(weight[:, args.qk_nope_head_dim :, :]),
    }
    for name, part in parts.items():
        if quantized is not None and part.shape[-1] % quantized["group_size"] == 0:
            part, weights[f"{prefix}.{name}.scales"], weights[f"{prefix}.{name}.biases"] = mx.quantize(
                part, **quantized
            )
        weights[f"{prefix}.{name}.weight"] = part
