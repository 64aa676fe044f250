"""Layers Gemma 2 and Gemma 3 share; definitions follow transformers' modeling_gemma2.py / modeling_gemma3.py.

Both families: embeddings scaled by sqrt(hidden_size) (in the embedding's dtype), RMSNorm with a
(1 + weight) gain, a GeGLU MLP (tanh GELU), sandwich norms (pre + post around attention and around the
MLP), alternating sliding-window / global attention layers, the attention scale from
`query_pre_attn_scalar`, tied embeddings and optional final-logit soft-capping. Attention, the gated
MLP and the embed -> layers -> norm -> head wrapper are transformer.py's; the family modules supply the
config dataclass, a RoPE per layer type, and whether attention has q/k norms and soft-capping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..errors import UnsupportedModelError
from .activations import geglu, softcap
from .base import BaseModelArgs, LayerCache
from .rope import RoPE
from .transformer import Attention, GatedMLP, TransformerLM

SLIDING, FULL = "sliding_attention", "full_attention"
# All name the same tanh approximation of GELU (transformers' GELUTanh / NewGELU / FastGELU).
GELU_TANH = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu_tanh")

# Multimodal checkpoints (Gemma 3 image-text) keep the text tower under a prefix: transformers < 5 and
# mlx-vlm write `language_model.model.`, transformers 5 writes `model.language_model.`.
_RENAMES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_DROPPED = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
    "vision_model.",
    "model.vision_model.",
)


@dataclass
class GemmaArgs(BaseModelArgs):
    """Fields both families read; defaults are transformers' Gemma2Config defaults (hub configs omit defaults)."""

    hidden_size: int = 2304
    num_hidden_layers: int = 26
    intermediate_size: int = 9216
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    vocab_size: int = 256000
    model_type: str = "gemma2"
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 8192
    query_pre_attn_scalar: float = 256
    sliding_window: int | None = 4096
    layer_types: list[str] | None = None
    final_logit_softcapping: float | None = 30.0
    attn_logit_softcapping: float | None = 50.0
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    hidden_activation: str | None = "gelu_pytorch_tanh"
    rope_theta: float | None = None
    rope_parameters: dict[str, Any] | None = None
    rope_scaling: dict[str, Any] | None = None
    use_bidirectional_attention: bool | None = False

    def default_layer_types(self) -> list[str]:
        raise NotImplementedError

    def __post_init__(self):
        if self.hidden_activation is not None and self.hidden_activation not in GELU_TANH:
            raise UnsupportedModelError(
                f"hidden_activation '{self.hidden_activation}' is not supported for {self.model_type}"
            )
        if self.use_bidirectional_attention:
            raise UnsupportedModelError(
                f"{self.model_type} with bidirectional attention is an encoder, not a causal LM"
            )
        if self.layer_types is None:
            self.layer_types = self.default_layer_types()
        self.layer_types = list(self.layer_types)[: self.num_hidden_layers]
        unknown = sorted(set(self.layer_types) - {SLIDING, FULL})
        if unknown or len(self.layer_types) != self.num_hidden_layers:
            raise UnsupportedModelError(
                f"{self.model_type} layer_types {unknown or self.layer_types} are not supported"
            )


class RMSNorm(nn.Module):
    """x / rms(x) * (1 + weight); the checkpoint stores weight centred on 0."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)


def gemma_attention(args: GemmaArgs, layer_type: str, rope: RoPE, qk_norm: bool, softcap: float | None) -> Attention:
    """Scaled by `query_pre_attn_scalar`; sliding layers see the last `sliding_window` keys (the cache masks)."""
    window = args.sliding_window if layer_type == SLIDING else None
    return Attention(
        args,
        rope,
        bias=args.attention_bias,
        window=window,
        softcap=softcap,
        scale=float(args.query_pre_attn_scalar) ** -0.5,
        qk_norm=RMSNorm if qk_norm else None,
    )


class DecoderLayer(nn.Module):
    def __init__(self, args: GemmaArgs, self_attn: Attention):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = GatedMLP(args.hidden_size, args.intermediate_size, activation=geglu)
        dims, eps = args.hidden_size, args.rms_norm_eps
        self.input_layernorm = RMSNorm(dims, eps)
        self.post_attention_layernorm = RMSNorm(dims, eps)
        self.pre_feedforward_layernorm = RMSNorm(dims, eps)
        self.post_feedforward_layernorm = RMSNorm(dims, eps)

    def __call__(self, x: mx.array, cache: LayerCache | None, last_only: bool = False) -> mx.array:
        """`last_only`: the last position's output only, every position's keys and values cached."""
        attended = self.self_attn(self.input_layernorm(x), cache, last_only=last_only)
        h = (x[:, -1:, :] if last_only else x) + self.post_attention_layernorm(attended)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class GemmaCausalLM(TransformerLM):
    """`ropes` by layer type; `qk_norm` (Gemma 3) and `attn_softcap` (Gemma 2) as gemma_attention takes them."""

    def __init__(self, args: GemmaArgs, ropes: dict[str, RoPE], qk_norm: bool, attn_softcap: float | None):
        layers = [
            DecoderLayer(args, gemma_attention(args, layer_type, ropes[layer_type], qk_norm, attn_softcap))
            for layer_type in args.layer_types
        ]
        super().__init__(args, layers, norm=RMSNorm, embed_scale=args.hidden_size**0.5)
        self.final_logit_softcapping = args.final_logit_softcapping

    def __call__(self, inputs: mx.array, cache=None, last_only: bool = False) -> mx.array:
        logits = super().__call__(inputs, cache, last_only)
        if self.final_logit_softcapping:
            logits = softcap(logits, self.final_logit_softcapping)
        return logits

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Multimodal checkpoints: the text tower's weights renamed, the vision tower's dropped."""
        return super().sanitize(text_tower_weights(weights))


def text_tower_weights(weights: dict[str, mx.array], dropped: tuple[str, ...] = _DROPPED) -> dict[str, mx.array]:
    """A multimodal checkpoint's text-model weights under the text model's names (`model.`, `lm_head.`), without
    the weights whose (renamed) names start with a `dropped` prefix (the other towers); a text checkpoint as it is."""
    out = {}
    for name, value in weights.items():
        for old, new in _RENAMES:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        if not name.startswith(dropped):
            out[name] = value
    return out
