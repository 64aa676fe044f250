"""LFM2 (Liquid AI). Definition follows transformers' Lfm2Model.

A hybrid of two token mixers, chosen per layer by `layer_types` (older configs: `full_attn_idxs` lists the attention
layers, every other layer is a short convolution):

- `conv`: `ShortConv`, a gated short convolution: in_proj gives B, C and x side by side; B * x goes through a causal
  depthwise convolution of `conv_L_cache` taps (no activation), and C times its output through out_proj. It keeps
  a recurrent state per sequence instead of keys and values (base.RecurrentCache): the convolution's last
  `conv_L_cache - 1` inputs.
- `full_attention`: Llama's grouped-query attention with per-head RMSNorms on queries and keys before RoPE.

Every layer's feed-forward block is a SwiGLU whose width transformers derives from `intermediate_size` (older configs:
`block_ff_dim`) when `block_auto_adjust_ff_dim` is set. The final norm is `model.embedding_norm`; the LM head is the
tied embedding unless `tie_word_embeddings` (older configs: `tie_embedding`) is false.

The checkpoints' parameter names differ from the shared blocks' (`out_proj`, `q_layernorm`, `feed_forward.w1`,
`operator_norm`, ...): `sanitize` maps them onto the stock Attention / GatedMLP names (NAMES), so that those blocks
and every backend path built on them serve LFM2's attention and MLPs unchanged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx
import mlx.nn as nn

from ..errors import UnsupportedModelError
from .base import RecurrentCache, normed
from .gated_delta import depthwise_taps
from .qwen2 import make_rope
from .transformer import Attention, GatedMLP, TransformerArgs, TransformerLM, add_projection

CONV, FULL = "conv", "full_attention"
# Checkpoint name -> the stock blocks' name, matched on whole dotted segments.
NAMES = {
    "self_attn.out_proj": "self_attn.o_proj",
    "self_attn.q_layernorm": "self_attn.q_norm",
    "self_attn.k_layernorm": "self_attn.k_norm",
    "feed_forward.w1": "feed_forward.gate_proj",
    "feed_forward.w3": "feed_forward.up_proj",
    "feed_forward.w2": "feed_forward.down_proj",
    "operator_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "model.embedding_norm": "model.norm",
}
_NAMES = re.compile(r"(?<![\w])(" + "|".join(re.escape(k) for k in NAMES) + r")(?=\.)")


@dataclass
class ModelArgs(TransformerArgs):
    """Lfm2Config's fields and defaults, with the older checkpoints' keys (`block_ff_dim`, `tie_embedding`,
    `full_attn_idxs`, `rope_theta`)."""

    hidden_size: int = 2560
    num_hidden_layers: int = 32
    intermediate_size: int = 12288
    num_attention_heads: int = 32
    vocab_size: int = 65536
    model_type: str = "lfm2"
    num_key_value_heads: int | None = 8
    max_position_embeddings: int = 128000
    tie_word_embeddings: bool = True
    norm_eps: float = 1e-5
    conv_bias: bool = False
    conv_L_cache: int = 3
    block_multiple_of: int = 256
    block_ffn_dim_multiplier: float | None = 1.0
    block_auto_adjust_ff_dim: bool = True
    full_attn_idxs: list[int] | None = None
    layer_types: list[str] | None = None
    block_ff_dim: int | None = None  # older configs: the feed-forward width before adjustment
    tie_embedding: bool | None = None  # older configs' tie_word_embeddings

    default_rope_theta: ClassVar[float] = 1e6

    def __post_init__(self):
        super().__post_init__()
        self.rms_norm_eps = self.norm_eps
        if self.block_ff_dim is not None:
            self.intermediate_size = self.block_ff_dim
        if self.tie_embedding is not None:
            self.tie_word_embeddings = self.tie_embedding
        if self.layer_types is None:
            attention = set(range(self.num_hidden_layers) if self.full_attn_idxs is None else self.full_attn_idxs)
            self.layer_types = [FULL if i in attention else CONV for i in range(self.num_hidden_layers)]
        unknown = sorted(set(self.layer_types) - {CONV, FULL})
        if unknown or len(self.layer_types) != self.num_hidden_layers:
            raise UnsupportedModelError(f"lfm2 layer_types {unknown or self.layer_types} are not supported")
        if self.conv_L_cache < 2:
            raise UnsupportedModelError(f"lfm2 conv_L_cache {self.conv_L_cache} (< 2) is not supported")
        self.ff_dim = self.feed_forward_width()

    def feed_forward_width(self) -> int:
        """Lfm2MLP's width: 2/3 of intermediate_size, times block_ffn_dim_multiplier rounded up to block_multiple_of
        (the rounding only with a multiplier, as transformers)."""
        width = self.intermediate_size
        if self.block_auto_adjust_ff_dim:
            width = int(2 * width / 3)
            if self.block_ffn_dim_multiplier is not None:
                width = int(self.block_ffn_dim_multiplier * width)
                multiple = self.block_multiple_of
                width = multiple * ((width + multiple - 1) // multiple)
        return width


def causal_conv1d(
    x: mx.array, state: mx.array | None, weight: mx.array, bias: mx.array | None = None
) -> tuple[mx.array, mx.array]:
    """Depthwise causal convolution of x [B, L, C] with `weight` [C, 1, K] (torch's layout, as checkpoints store it)
    and an optional `bias` [C], after the previous K - 1 inputs `state` [B, K - 1, C] (None: zeros), no activation;
    returns (output [B, L, C], the new state: the last K - 1 inputs)."""
    K = weight.shape[-1]
    if state is None:
        state = mx.zeros((x.shape[0], K - 1, x.shape[-1]), x.dtype)
    padded = mx.concatenate([state.astype(x.dtype), x], axis=1)
    out = depthwise_taps(padded, weight)
    if bias is not None:
        out = out + bias.astype(x.dtype)
    return out, padded[:, padded.shape[1] - (K - 1) :, :]


class DepthwiseConv(nn.Module):
    """A depthwise convolution's parameters as transformers stores them (weight [C, 1, K], optional bias [C]);
    causal_conv1d computes it."""

    def __init__(self, channels: int, kernel: int, bias: bool):
        super().__init__()
        self.weight = mx.zeros((channels, 1, kernel))
        if bias:
            self.bias = mx.zeros((channels,))


def zero_padding(x: mx.array, cache: RecurrentCache | None) -> mx.array:
    """x [B, L, C] with each row's left-padding columns (cache.state_padding) zeroed: zero inputs leave a zero
    convolution state as it is, so a padded row's state is its unpadded one."""
    padding = None if cache is None else cache.state_padding
    if padding is None:
        return x
    return mx.where((mx.arange(x.shape[1])[None, :] >= padding[:, None])[..., None], x, mx.zeros((), x.dtype))


class ShortConv(nn.Module):
    """Lfm2ShortConv: out_proj(C * conv(B * x)) with B, C, x = in_proj(input)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.hidden_size, self.kernel = args.hidden_size, args.conv_L_cache
        self.conv = DepthwiseConv(args.hidden_size, args.conv_L_cache, args.conv_bias)
        self.in_proj = nn.Linear(args.hidden_size, 3 * args.hidden_size, bias=args.conv_bias)
        self.out_proj = nn.Linear(args.hidden_size, args.hidden_size, bias=args.conv_bias)

    def __call__(
        self,
        x: mx.array,
        cache: RecurrentCache | None,
        residual: mx.array | None = None,
        norm: nn.Module | None = None,
        last_only: bool = False,
    ) -> mx.array:
        """`cache` holds the rows' convolution inputs; `last_only`: the state takes every position, the output (and
        the residual) is the last position's only."""
        b, c, h = mx.split(self.in_proj(normed(x, norm)), 3, axis=-1)
        state = None if cache is None else cache.recurrent_state()
        previous = None if state is None else state[0]
        out, state = causal_conv1d(zero_padding(b * h, cache), previous, self.conv.weight, self.conv.get("bias"))
        if cache is not None:
            cache.update_state([state], x.shape[1])
        if last_only:
            out, c = out[:, -1:], c[:, -1:]
            residual = None if residual is None else residual[:, -1:]
        return add_projection(self.out_proj, c * out, residual)

    def state_parts(self) -> tuple:
        """The per-row state this layer keeps (base.state_layout): the convolution's last K - 1 inputs."""
        return (((self.kernel - 1, self.hidden_size), None),)


class Lfm2Layer(nn.Module):
    """Lfm2DecoderLayer: pre-norm residual layer over either token mixer (`conv` or `self_attn`), then the SwiGLU."""

    def __init__(self, args: ModelArgs, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.mixer_name = "conv" if layer_type == CONV else "self_attn"
        mixer = ShortConv(args) if layer_type == CONV else Attention(args, make_rope(args), qk_norm=nn.RMSNorm)
        setattr(self, self.mixer_name, mixer)
        self.feed_forward = GatedMLP(args.hidden_size, args.ff_dim)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, cache, last_only: bool = False) -> mx.array:
        h = self[self.mixer_name](x, cache, residual=x, norm=self.input_layernorm, last_only=last_only)
        return self.feed_forward(h, residual=h, norm=self.post_attention_layernorm)


class Model(TransformerLM):
    def __init__(self, args: ModelArgs):
        super().__init__(args, [Lfm2Layer(args, kind) for kind in args.layer_types])

    def kv_layout(self) -> list[tuple[int, int] | None]:
        """Keys and values only in the attention layers (base.kv_layout)."""
        kv = (self.args.num_key_value_heads, self.args.head_dim)
        return [kv if layer.layer_type == FULL else None for layer in self.layers]

    def state_layout(self) -> list[tuple | None]:
        """A recurrent state in the convolution layers (base.state_layout)."""
        return [layer.conv.state_parts() if layer.layer_type == CONV else None for layer in self.layers]

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Checkpoint names mapped onto the stock blocks' (NAMES); a convolution weight in MLX's layout [C, K, 1] (an
        mlx-lm conversion) goes back to transformers' [C, 1, K]."""
        renamed = {}
        for name, value in super().sanitize(weights).items():
            name = _NAMES.sub(lambda m: NAMES[m.group(1)], name)
            if name.endswith("conv.conv.weight") and value.shape[-1] == 1 and value.shape[1] != 1:
                value = mx.moveaxis(value, 2, 1)
            renamed[name] = value
        return renamed
