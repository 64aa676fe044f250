"""Qwen3-Next. Definition follows transformers' Qwen3NextModel.

A hybrid of two token mixers, chosen per layer by `layer_types` (older configs: every `full_attention_interval`-th
layer is full attention, the others linear):

- `linear_attention`: a gated delta-net (`GatedDeltaNet`): q/k/v through a causal depthwise convolution (SiLU),
  the gated delta rule (models/gated_delta.py) over them, a gated RMSNorm (norm(x) * weight * silu(z)), out_proj.
  It keeps a recurrent state per sequence instead of keys and values (base.RecurrentCache): the convolution's last
  K - 1 inputs and the delta rule's state.
- `full_attention`: `GatedAttention`, Qwen3's attention with the query projection twice as wide (each head's query
  and an output gate), the output multiplied by sigmoid(gate); q/k norms; partial rotary (`partial_rotary_factor`,
  default 0.25).

Every RMSNorm except the delta-net's gated one scales by (1 + weight) (zero-centred weights, gemma_common.RMSNorm).
The MLP of layer i is a sparse MoE block with a shared expert whose output is scaled by sigmoid(shared_expert_gate)
(unless i is in `mlp_only_layers` or (i + 1) is not a multiple of `decoder_sparse_step`: a dense SwiGLU). Qwen3.5
(qwen3_5.py) shares all of this but its delta-net projections and its MLPs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from ..errors import UnsupportedModelError
from .base import RecurrentCache, attention, cache_offset, normed
from .gated_delta import causal_conv, gated_delta
from .gemma_common import RMSNorm
from .moe import SparseMoeBlock, stack_experts
from .rope import initialize_rope
from .transformer import Attention, GatedMLP, TransformerArgs, TransformerLM, add_projection, heads_first, heads_last

LINEAR, FULL = "linear_attention", "full_attention"
# The (1 + weight) norms, which mlx-lm's conversions store as 1 + weight.
SHIFTED_NORMS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "model.norm.weight",
    "q_norm.weight",
    "k_norm.weight",
)


@dataclass
class ModelArgs(TransformerArgs):
    """Qwen3NextConfig's fields and defaults."""

    model_type: str = "qwen3_next"
    num_key_value_heads: int | None = 2
    head_dim: int | None = 256
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    partial_rotary_factor: float | None = None  # older configs' top-level key; transformers 5: in rope_parameters
    layer_types: list[str] | None = None
    full_attention_interval: int = 4  # older configs: which layers are full attention when layer_types is absent
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    decoder_sparse_step: int = 1
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts_per_tok: int = 10
    num_experts: int = 512
    norm_topk_prob: bool = True
    mlp_only_layers: list[int] = field(default_factory=list)

    def __post_init__(self):
        raw_rope = self.rope_scaling or self.rope_parameters or {}  # before super() standardizes rope_scaling
        super().__post_init__()
        factor = raw_rope.get("partial_rotary_factor", self.partial_rotary_factor)
        self.partial_rotary_factor = 0.25 if factor is None else float(factor)
        self.rotary_dims = int(self.head_dim * self.partial_rotary_factor)
        if self.layer_types is None:
            every = self.full_attention_interval
            self.layer_types = [FULL if (i + 1) % every == 0 else LINEAR for i in range(self.num_hidden_layers)]
        unknown = sorted(set(self.layer_types) - {LINEAR, FULL})
        if unknown or len(self.layer_types) != self.num_hidden_layers:
            raise UnsupportedModelError(
                f"{self.model_type} layer_types {unknown or self.layer_types} are not supported"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise UnsupportedModelError(
                f"{self.model_type}: linear_num_value_heads {self.linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads {self.linear_num_key_heads}"
            )
        self.mlp_only_layers = list(self.mlp_only_layers or [])

    def is_sparse(self, layer_idx: int) -> bool:
        return (
            layer_idx not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )


class GatedRMSNorm(nn.Module):
    """Qwen3NextRMSNormGated: rms_norm(x) * weight * silu(gate), the product in float32, in x's dtype."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        gate = gate.astype(mx.float32)
        return (mx.fast.rms_norm(x, self.weight, self.eps) * (mx.sigmoid(gate) * gate)).astype(x.dtype)


class CausalConv1d(nn.Module):
    """The delta-net's depthwise causal convolution weights, [C, 1, K] as transformers stores them (gated_delta's
    causal_conv computes it), so that a checkpoint mlxcel writes keeps transformers' layout."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = mx.zeros((channels, 1, kernel))


class GatedDeltaNet(nn.Module):
    """Qwen3NextGatedDeltaNet: the linear-attention token mixer. Its projections (`init_projections`, `project`) are
    the override points Qwen3.5 changes; the rest (convolution, delta rule, gated norm) is shared. `mix` (convolution
    and delta rule over the rows' state) is where a backend's decode kernels come in."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_k_heads, self.num_v_heads = args.linear_num_key_heads, args.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = args.linear_key_head_dim, args.linear_value_head_dim
        self.key_dim, self.value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = args.linear_conv_kernel_dim
        self.conv1d = CausalConv1d(self.conv_dim, self.conv_kernel)
        self.init_projections(args.hidden_size)
        self.dt_bias = mx.ones((self.num_v_heads,))
        self.A_log = mx.zeros((self.num_v_heads,))
        self.norm = GatedRMSNorm(self.head_v_dim, eps=args.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, args.hidden_size, bias=False)

    def init_projections(self, hidden_size: int) -> None:
        self.in_proj_qkvz = nn.Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(hidden_size, 2 * self.num_v_heads, bias=False)

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """(q, k and v side by side [B, L, conv_dim], z [B, L, Hv, Dv], b and a [B, L, Hv]): Qwen3-Next's fused
        projections hold them grouped per key head (fix_query_key_value_ordering)."""
        B, L, _ = x.shape
        nk, per = self.num_k_heads, self.num_v_heads // self.num_k_heads
        dk, dv = self.head_k_dim, self.head_v_dim
        qkvz = self.in_proj_qkvz(x).reshape(B, L, nk, 2 * dk + 2 * per * dv)
        q, k, v, z = mx.split(qkvz, [dk, 2 * dk, 2 * dk + per * dv], axis=-1)
        b, a = mx.split(self.in_proj_ba(x).reshape(B, L, nk, 2 * per), [per], axis=-1)
        mixed = mx.concatenate([t.reshape(B, L, -1) for t in (q, k, v)], axis=-1)
        return mixed, z.reshape(B, L, -1, dv), b.reshape(B, L, -1), a.reshape(B, L, -1)

    def __call__(
        self,
        x: mx.array,
        cache: RecurrentCache | None,
        residual: mx.array | None = None,
        norm: nn.Module | None = None,
        last_only: bool = False,
    ) -> mx.array:
        """`cache` holds the rows' state ([conv inputs, delta-rule state]); `last_only`: the state takes every
        position, the output (and the residual) is the last position's only."""
        x = normed(x, norm)
        L = x.shape[1]
        padding = None if cache is None else cache.state_padding
        if padding is not None:  # a left-padded row's pad columns: zero inputs leave a zero state as it is
            x = mx.where((mx.arange(L)[None, :] >= padding[:, None])[..., None], x, mx.zeros((), x.dtype))
        mixed, z, b, a = self.project(x)
        out = self.mix(mixed, b, a, cache)
        if last_only:
            out, z = out[:, -1:], z[:, -1:]
            residual = None if residual is None else residual[:, -1:]
        out = self.norm(out, z).reshape(out.shape[0], out.shape[1], -1)
        return add_projection(self.out_proj, out, residual)

    def mix(self, mixed: mx.array, b: mx.array, a: mx.array, cache: RecurrentCache | None) -> mx.array:
        """The token mixing after the projections (the override point a backend's decode kernels take): the causal
        convolution over q, k and v side by side (`mixed` [B, L, conv_dim]), the gated delta rule with beta =
        sigmoid(b) and the log decay from `a` [B, L, Hv], the rows' state read from and written to `cache`; returns
        the outputs [B, L, Hv, Dv]."""
        B, L, _ = mixed.shape
        state = None if cache is None else cache.recurrent_state()
        conv_state, delta_state = (None, None) if state is None else state
        mixed, conv_state = causal_conv(mixed, conv_state, self.conv1d.weight)
        q, k, v = mx.split(mixed, [self.key_dim, 2 * self.key_dim], axis=-1)
        q, k = (t.reshape(B, L, self.num_k_heads, self.head_k_dim) for t in (q, k))
        v = v.reshape(B, L, self.num_v_heads, self.head_v_dim)
        g = -mx.exp(self.A_log.astype(mx.float32)) * nn.softplus(a.astype(mx.float32) + self.dt_bias)
        out, delta_state = gated_delta(q, k, v, mx.sigmoid(b), g, delta_state)
        if cache is not None:
            cache.update_state([conv_state, delta_state], L)
        return out

    def state_parts(self) -> tuple:
        """The per-row state this layer keeps (base.state_layout): the convolution's inputs (activations' dtype)
        and the delta rule's float32 state."""
        return ((self.conv_kernel - 1, self.conv_dim), None), (
            (self.num_v_heads, self.head_k_dim, self.head_v_dim),
            mx.float32,
        )


class GatedAttention(Attention):
    """Qwen3NextAttention: q_proj gives each head's query and an output gate side by side; the attention output is
    multiplied by sigmoid(gate) before o_proj. q/k norms are (1 + weight) RMSNorms; RoPE turns `rotary_dims`."""

    def __init__(self, args: ModelArgs):
        rope = initialize_rope(
            args.rotary_dims,
            args.rope_base,
            False,
            args.rope_scaling,
            max_position_embeddings=args.max_position_embeddings,
        )
        super().__init__(args, rope, bias=args.attention_bias, qk_norm=RMSNorm)
        self.q_proj = nn.Linear(args.hidden_size, 2 * self.n_heads * self.head_dim, bias=args.attention_bias)

    def __call__(self, x, cache, residual=None, norm=None, last_only: bool = False) -> mx.array:
        q, k, v = self.project(x, norm)
        B, L, _ = x.shape
        q, gate = mx.split(q.reshape(B, L, self.n_heads, 2 * self.head_dim), 2, axis=-1)
        gate = gate.reshape(B, L, -1)
        q = self.q_norm(heads_first(q.reshape(B, L, -1), self.n_heads))
        k = self.k_norm(heads_first(k, self.n_kv_heads))
        v = heads_first(v, self.n_kv_heads)
        offset = cache_offset(cache)
        q, k = self.rope(q, offset), self.rope(k, offset)
        if last_only:
            q, gate = q[:, :, -1:, :], gate[:, -1:]
            residual = None if residual is None else residual[:, -1:, :]
        out = heads_last(attention(q, k, v, cache, self.scale))
        return add_projection(self.o_proj, out * mx.sigmoid(gate), residual)


class SharedExpertMoe(SparseMoeBlock):
    """Qwen3NextSparseMoeBlock: the routed experts plus a shared SwiGLU expert scaled by sigmoid(shared_expert_gate)."""

    def __init__(self, args: ModelArgs):
        super().__init__(
            args.hidden_size,
            args.moe_intermediate_size,
            args.num_experts,
            args.num_experts_per_tok,
            args.norm_topk_prob,
        )
        self.shared_expert = GatedMLP(args.hidden_size, args.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(args.hidden_size, 1, bias=False)

    def __call__(self, x: mx.array, residual: mx.array | None = None, norm: nn.Module | None = None) -> mx.array:
        x = normed(x, norm)
        y = super().__call__(x) + mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y if residual is None else residual + y


class HybridLayer(nn.Module):
    """Pre-norm residual layer over either token mixer (`linear_attn` or `self_attn`), (1 + weight) RMSNorms."""

    def __init__(self, args, layer_type: str, mixer: nn.Module, mlp: nn.Module):
        super().__init__()
        self.layer_type = layer_type
        self.mixer_name = "linear_attn" if layer_type == LINEAR else "self_attn"
        setattr(self, self.mixer_name, mixer)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, cache, last_only: bool = False) -> mx.array:
        h = self[self.mixer_name](x, cache, residual=x, norm=self.input_layernorm, last_only=last_only)
        return self.mlp(h, residual=h, norm=self.post_attention_layernorm)


class Model(TransformerLM):
    """Qwen3.5 subclasses it, overriding `make_delta_net` and `make_mlp`."""

    def __init__(self, args: ModelArgs):
        layers = [
            HybridLayer(
                args,
                kind,
                self.make_delta_net(args) if kind == LINEAR else GatedAttention(args),
                self.make_mlp(args, i),
            )
            for i, kind in enumerate(args.layer_types)
        ]
        super().__init__(args, layers, norm=RMSNorm)

    @staticmethod
    def make_delta_net(args) -> nn.Module:
        return GatedDeltaNet(args)

    @staticmethod
    def make_mlp(args, layer_idx: int) -> nn.Module:
        if args.is_sparse(layer_idx):
            return SharedExpertMoe(args)
        return GatedMLP(args.hidden_size, args.intermediate_size)

    def kv_layout(self) -> list[tuple[int, int] | None]:
        """Keys and values only in the full-attention layers (base.kv_layout)."""
        kv = (self.args.num_key_value_heads, self.args.head_dim)
        return [kv if layer.layer_type == FULL else None for layer in self.layers]

    def state_layout(self) -> list[tuple | None]:
        """A recurrent state in the linear-attention layers (base.state_layout)."""
        return [layer.linear_attn.state_parts() if layer.layer_type == LINEAR else None for layer in self.layers]

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Multi-token prediction layers (`mtp.*`) dropped; expert banks stacked. A checkpoint whose conv1d weights are
        in MLX's layout [C, K, 1] is an mlx-lm conversion, which also stored the (1 + weight) norms with the 1 added
        (mlx-lm computes them as plain RMSNorms): the layout goes back to [C, 1, K] and the 1 comes off."""
        weights = {k: v for k, v in super().sanitize(weights).items() if not k.startswith("mtp.")}
        mlx_lm = any(k.endswith("conv1d.weight") and v.shape[-1] == 1 for k, v in weights.items())
        for name, value in weights.items():
            if mlx_lm and name.endswith("conv1d.weight"):
                weights[name] = mx.moveaxis(value, 2, 1)
            elif mlx_lm and name.endswith(SHIFTED_NORMS):
                weights[name] = value - 1
        for i in range(self.args.num_hidden_layers):
            if self.args.is_sparse(i):
                weights = stack_experts(weights, f"model.layers.{i}.mlp", self.args.num_experts)
        return weights
