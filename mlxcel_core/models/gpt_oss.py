"""gpt-oss family (gpt-oss-20b / gpt-oss-120b). Definition follows transformers' GptOssForCausalLM.

Nearest relative: Qwen3-MoE (GQA attention, a sparse MoE in every layer), with these differences:
- attention has q/k/v/o biases (`attention_bias`) and sinks: a learned logit per query head that joins each softmax's
  denominator and carries no value (`self_attn.sinks`; every cache and the paged storage take them, see
  models/base.py `attention`);
- layers alternate sliding-window and full attention (`layer_types`, by default sliding at even indices, full at odd
  ones; `sliding_window` keys);
- RoPE is YaRN by default (factor 32 over 4096 original positions, truncate off, theta 150k), also when config.json
  names only `rope_theta`, as GptOssConfig fills it;
- the router is a biased linear layer (`mlp.router`); a token takes the top `num_experts_per_tok` logits, and the
  softmax runs over those alone;
- each expert's projections carry biases, and its activation is the clamped SwiGLU: gate clamped above at
  `swiglu_limit`, up clamped to +-limit, (up + 1) * gate * sigmoid(swiglu_alpha * gate).

Checkpoints store the experts fused: transformers' `experts.gate_up_proj` [E, hidden, 2 x inter] with gate in the
even columns and up in the odd ones, `experts.down_proj` [E, inter, hidden], biases `*_bias`. The released checkpoints
(config.json `quantization_config: {quant_method: mxfp4}`) store the projections as MXFP4 instead: `*_blocks` (uint8
[E, out, in / 32, 16], two FP4 E2M1 values a byte, low nibble first) and `*_scales` (uint8 E8M0 exponents [E, out,
in / 32]), groups of 32 along the input. That is MLX's "mxfp4" quantization byte for byte, so sanitize hands the
bytes over as packed uint32 weights and scales (no dequantization) and the loader builds MLX mxfp4 expert banks
from them (loading/weights.py). Either way the banks are mlx-lm's `mlp.experts.{gate,up,down}_proj`, so mlx-lm
conversions load as they are.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn

from ..errors import CorruptModelError, UnsupportedModelError
from .base import normed
from .moe import SwitchGLU
from .rope import initialize_rope
from .transformer import Attention, DecoderLayer, TransformerArgs, TransformerLM

SLIDING, FULL = "sliding_attention", "full_attention"
# GptOssConfig's RoPE when config.json has neither rope_parameters nor rope_scaling (rope_theta joins it).
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


@dataclass
class ModelArgs(TransformerArgs):
    """Defaults are GptOssConfig's (released config.json files name most of them)."""

    hidden_size: int = 2880
    num_hidden_layers: int = 36
    intermediate_size: int = 2880
    num_attention_heads: int = 64
    vocab_size: int = 201088
    model_type: str = "gpt_oss"
    rms_norm_eps: float = 1e-5
    num_key_value_heads: int | None = 8
    head_dim: int | None = 64
    max_position_embeddings: int = 131072
    sliding_window: int | None = 128
    layer_types: list[str] | None = None
    attention_bias: bool = True
    num_local_experts: int = 128
    num_experts: int | None = None  # GptOssConfig's attribute_map: another name of num_local_experts
    num_experts_per_tok: int = 4
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    quantization_config: dict[str, Any] | None = None

    default_rope_theta: ClassVar[float] = 150000.0

    def __post_init__(self):
        self.hidden_act = "silu"  # GptOss never reads hidden_act: its experts' activation is the clamped SwiGLU
        if self.rope_parameters is None and self.rope_scaling is None:
            self.rope_parameters = dict(DEFAULT_ROPE)
        super().__post_init__()
        if self.num_experts is not None:
            self.num_local_experts = self.num_experts
        if self.layer_types is None:
            self.layer_types = [SLIDING if (i + 1) % 2 else FULL for i in range(self.num_hidden_layers)]
        unknown = sorted(set(self.layer_types) - {SLIDING, FULL})
        if unknown or len(self.layer_types) != self.num_hidden_layers:
            raise UnsupportedModelError(f"gpt_oss layer_types {unknown or self.layer_types} are not supported")
        self.windows = [self.sliding_window if kind == SLIDING else None for kind in self.layer_types]
        method = (self.quantization_config or {}).get("quant_method")
        if method not in (None, "mxfp4"):
            raise UnsupportedModelError(
                f"gpt_oss quantization_config quant_method '{method}' is not supported (supported: mxfp4)"
            )

    def experts_in_mxfp4(self, layer_idx: int) -> bool:
        """Whether config.json says layer `layer_idx`'s experts are stored as MXFP4: quant_method mxfp4 and no
        `modules_to_not_convert` pattern matching them (transformers' should_convert_module: a prefix up to a module
        boundary, a regex with that boundary, or a suffix)."""
        config = self.quantization_config or {}
        if config.get("quant_method") != "mxfp4":
            return False
        name = f"model.layers.{layer_idx}.mlp.experts"
        boundary = r"(?:(?<=\.)|(?=\.|$))"
        patterns = config.get("modules_to_not_convert") or []
        return not any(re.match(rf"(?:{key}){boundary}", name) or name.endswith(key) for key in patterns)


_activations: dict[tuple[float, float], Any] = {}


def clamped_swiglu(alpha: float, limit: float):
    """GptOssExperts._apply_gate as one compiled element-wise function of (gate, up) (made once per alpha, limit)."""
    key = (float(alpha), float(limit))
    if key not in _activations:

        def act(gate: mx.array, up: mx.array) -> mx.array:
            gate = mx.minimum(gate, key[1])
            up = mx.clip(up, -key[1], key[1])
            return (up + 1) * (gate * mx.sigmoid(gate * key[0]))

        _activations[key] = mx.compile(act, shapeless=True)
    return _activations[key]


class SparseMoeBlock(nn.Module):
    """GptOssMLP: a biased router, top-k of its logits, softmax over those k, biased clamped-SwiGLU experts."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.router = nn.Linear(args.hidden_size, args.num_local_experts, bias=True)
        activation = clamped_swiglu(args.swiglu_alpha, args.swiglu_limit)
        self.experts = SwitchGLU(
            args.hidden_size, args.intermediate_size, args.num_local_experts, bias=True, activation=activation
        )

    def __call__(self, x: mx.array, residual: mx.array | None = None, norm: nn.Module | None = None) -> mx.array:
        x = normed(x, norm)
        logits = self.router(x)
        k = self.top_k
        indices = mx.stop_gradient(mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k])
        scores = mx.softmax(mx.take_along_axis(logits, indices, axis=-1), axis=-1, precise=True)
        y = self.experts(x, indices)
        y = (y * scores[..., None].astype(y.dtype)).sum(axis=-2)
        return y if residual is None else residual + y


class Model(TransformerLM):
    def __init__(self, args: ModelArgs):
        rope = initialize_rope(
            args.head_dim,
            args.rope_base,
            False,
            args.rope_scaling,
            max_position_embeddings=args.max_position_embeddings,
        )
        layers = [
            DecoderLayer(
                args, Attention(args, rope, bias=args.attention_bias, window=window, sinks=True), SparseMoeBlock(args)
            )
            for window in args.windows
        ]
        super().__init__(args, layers)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = super().sanitize(weights)
        for i in range(self.args.num_hidden_layers):
            weights = expert_banks(weights, f"model.layers.{i}.mlp.experts", self.args.experts_in_mxfp4(i))
        return weights


def expert_banks(weights: dict[str, mx.array], prefix: str, mxfp4: bool) -> dict[str, mx.array]:
    """`{prefix}.gate_up_proj*` / `{prefix}.down_proj*` (fused, or MXFP4 blocks and scales) -> `{prefix}.{gate,up,down}
    _proj.{weight,scales,bias}` ([E, out, in] banks, packed where MXFP4); gate_up's even outputs are the gate, its odd
    ones the up projection. Banks already in that layout (mlx-lm) pass unchanged. `mxfp4`: config.json says this
    layer's experts are MXFP4."""
    if f"{prefix}.gate_up_proj_blocks" in weights:
        if not mxfp4:
            raise CorruptModelError(
                f"{prefix} is stored as MXFP4 blocks, but config.json's quantization_config does not say so"
            )
        parts, down = (
            {"weight": packed(weights.pop(f"{prefix}.{name}_blocks")), "scales": weights.pop(f"{prefix}.{name}_scales")}
            for name in ("gate_up_proj", "down_proj")
        )
    elif f"{prefix}.gate_up_proj" in weights:
        parts = {"weight": weights.pop(f"{prefix}.gate_up_proj").swapaxes(1, 2)}  # [E, 2 x inter, hidden]
        down = {"weight": weights.pop(f"{prefix}.down_proj").swapaxes(1, 2)}
    else:
        return weights
    if f"{prefix}.gate_up_proj_bias" in weights:
        parts["bias"] = weights.pop(f"{prefix}.gate_up_proj_bias")  # [E, 2 x inter]
        down["bias"] = weights.pop(f"{prefix}.down_proj_bias")
    for suffix, value in parts.items():  # axis 1: the outputs (rows of the banks, entries of the biases)
        weights[f"{prefix}.gate_proj.{suffix}"] = mx.contiguous(value[:, 0::2])
        weights[f"{prefix}.up_proj.{suffix}"] = mx.contiguous(value[:, 1::2])
    for suffix, value in down.items():
        weights[f"{prefix}.down_proj.{suffix}"] = mx.contiguous(value)
    return weights


def packed(blocks: mx.array) -> mx.array:
    """MXFP4 blocks [..., in / 32, 16] (bytes) as MLX's packed mxfp4 weight [..., in / 8] (uint32): the same bytes,
    viewed. MLX keeps element 2j in byte j's low nibble and 2j + 1 in its high one, as gpt-oss does (checked against
    transformers' dequantization in tests/mlxcel_core/models/test_gpt_oss.py)."""
    return blocks.reshape(*blocks.shape[:-2], -1).view(mx.uint32)
