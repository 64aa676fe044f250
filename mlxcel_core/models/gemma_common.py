"""Layers Gemma 2 and Gemma 3 share; definitions follow transformers' modeling_gemma2.py / modeling_gemma3.py.

Both families: embeddings scaled by sqrt(hidden_size) (in the embedding's dtype), RMSNorm with a
(1 + weight) gain, a GeGLU MLP (tanh GELU), sandwich norms (pre + post around attention and around the
MLP), alternating sliding-window / global attention layers, the attention scale from
`query_pre_attn_scalar`, tied embeddings and optional final-logit soft-capping. The family modules
supply the config dataclass and the per-layer attention (RoPE base, q/k norms, attention soft-capping).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from ..errors import UnsupportedModelError
from .activations import geglu, softcap
from .base import BaseModelArgs, LayerCache, attention, cache_offset
from .rope import RoPE

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
_DROPPED = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.",
            "vision_model.", "model.vision_model.")


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
                f"hidden_activation '{self.hidden_activation}' is not supported for {self.model_type}")
        if self.use_bidirectional_attention:
            raise UnsupportedModelError(f"{self.model_type} with bidirectional attention is an encoder, not a causal LM")
        if self.layer_types is None:
            self.layer_types = self.default_layer_types()
        self.layer_types = list(self.layer_types)[: self.num_hidden_layers]
        unknown = sorted(set(self.layer_types) - {SLIDING, FULL})
        if unknown or len(self.layer_types) != self.num_hidden_layers:
            raise UnsupportedModelError(f"{self.model_type} layer_types {unknown or self.layer_types} are not supported")


class RMSNorm(nn.Module):
    """x / rms(x) * (1 + weight); the checkpoint stores weight centred on 0."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)


class MLP(nn.Module):
    def __init__(self, args: GemmaArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(geglu(self.gate_proj(x), self.up_proj(x)))


class Attention(nn.Module):
    """GQA attention; sliding layers see the last `sliding_window` keys (the cache builds the mask)."""

    def __init__(self, args: GemmaArgs, layer_type: str, rope: RoPE, qk_norm: bool, softcap: float | None):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = float(args.query_pre_attn_scalar) ** -0.5
        self.window = args.sliding_window if layer_type == SLIDING else None
        self.softcap = softcap
        bias = args.attention_bias
        self.q_proj = nn.Linear(args.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=bias)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        self.qk_norm = qk_norm
        self.rope = rope

    def __call__(self, x: mx.array, cache: LayerCache | None) -> mx.array:
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        offset = cache_offset(cache)
        out = attention(self.rope(q, offset), self.rope(k, offset), v, cache, self.scale,
                        window=self.window, softcap=self.softcap)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DecoderLayer(nn.Module):
    def __init__(self, args: GemmaArgs, self_attn: Attention):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = MLP(args)
        dims, eps = args.hidden_size, args.rms_norm_eps
        self.input_layernorm = RMSNorm(dims, eps)
        self.post_attention_layernorm = RMSNorm(dims, eps)
        self.pre_feedforward_layernorm = RMSNorm(dims, eps)
        self.post_feedforward_layernorm = RMSNorm(dims, eps)

    def __call__(self, x: mx.array, cache: LayerCache | None) -> mx.array:
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cache))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class GemmaModel(nn.Module):
    def __init__(self, args: GemmaArgs, make_attention: Callable[[int, str], Attention]):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, make_attention(i, t)) for i, t in enumerate(args.layer_types)]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.embed_scale = args.hidden_size**0.5

    def __call__(self, inputs: mx.array, cache) -> mx.array:
        h = self.embed_tokens(inputs)
        h = h * mx.array(self.embed_scale, dtype=h.dtype)  # rounded to the embedding dtype, as transformers
        for layer, layer_cache in zip(self.layers, cache or [None] * len(self.layers)):
            h = layer(h, layer_cache)
        return self.norm(h)


class GemmaCausalLM(nn.Module):
    def __init__(self, args: GemmaArgs, make_attention: Callable[[int, str], Attention]):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = GemmaModel(args, make_attention)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.max_context_length = args.max_position_embeddings
        self.final_logit_softcapping = args.final_logit_softcapping

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        h = self.model(inputs, cache)
        logits = self.model.embed_tokens.as_linear(h) if self.args.tie_word_embeddings else self.lm_head(h)
        if self.final_logit_softcapping:
            logits = softcap(logits, self.final_logit_softcapping)
        return logits

    @property
    def layers(self):
        return self.model.layers

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        out = {}
        for name, value in weights.items():
            for old, new in _RENAMES:
                if name.startswith(old):
                    name = new + name[len(old):]
                    break
            if name.startswith(_DROPPED) or "rotary_emb.inv_freq" in name:
                continue
            if self.args.tie_word_embeddings and name.startswith("lm_head."):
                continue
            out[name] = value
        return out
