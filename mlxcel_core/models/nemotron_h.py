"""Nemotron-H (NVIDIA). Definition follows transformers' NemotronHModel.

A stack of single-mixer residual blocks (x + mixer(norm(x))), the mixer of block i chosen by `layers_block_type`
(older configs: the `hybrid_override_pattern` string, one character a block: M, *, E, -):

- `linear_attention` (M): `Mamba2Mixer`: in_proj gives the gate z, the convolution's input (x, B, C) and dt; a causal
  depthwise convolution (SiLU), the Mamba2 state-space scan (models/ssd.py), an RMSNorm per group of the gated output
  (norm(y * silu(z)) * weight), out_proj. It keeps a recurrent state per sequence (base.RecurrentCache): the
  convolution's last K - 1 inputs and the scan's float32 state.
- `full_attention` (*): grouped-query attention without position embeddings (NoPE), no biases.
- `moe` (E): sigmoid-routed experts with grouped top-k and a correction bias (grouped_moe.GroupedTopKRouter), each
  expert a non-gated relu^2 MLP, plus a shared relu^2 MLP; with `moe_latent_size` the routed experts work in a
  smaller latent space (fc1_latent_proj in, fc2_latent_proj out).
- `mlp` (-): the relu^2 MLP, down(relu(up(x))^2).

A prompt's tokens clamp dt to `time_step_limit` (transformers' chunked scan, its dt_limit; (0, inf) by default, as in
the released configs: `time_step_min` only initializes dt_bias in training); a decode step does not (its selective
state update): a 1-token forward on a row's state is a decode step here unless its cache says `prompt_tokens` (a
prefill chunk of one token), and so is a forward whose cache says `decode_tokens` (generated tokens several at a time:
speculative verification; engine/recurrent_rollback.py).

Checkpoint names: transformers' (`backbone.` or `model.` prefix, experts per expert or stacked as `experts.up_proj`
[E, I, in]) and mlx-lm's (`switch_mlp.fc1` / `fc2`, conv1d weights in MLX's [C, K, 1] layout) load alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx
import mlx.nn as nn

from ..errors import UnsupportedModelError
from .base import RecurrentCache, drop_extra_layers
from .grouped_moe import GroupedTopKRouter
from .lfm2 import DepthwiseConv, causal_conv1d, zero_padding
from .moe import SORT_THRESHOLD, SwitchLinear
from .smollm3 import NoPE
from .ssd import ssd_chunked, ssd_step
from .transformer import Attention, TransformerArgs

MAMBA, ATTENTION, MOE, MLP = "linear_attention", "full_attention", "moe", "mlp"
PATTERN = {"M": MAMBA, "*": ATTENTION, "E": MOE, "-": MLP}
# Older configs' key -> NemotronHConfig's field (transformers pops them in __post_init__).
ALIASES = {
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_expand": "expand",
    "mamba_dt_min": "time_step_min",
    "mamba_dt_max": "time_step_max",
    "mamba_dt_limit": "time_step_limit",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_chunk_size": "chunk_size",
}


@dataclass
class ModelArgs(TransformerArgs):
    """NemotronHConfig's fields and defaults that the forward reads; the block count is the block types' count."""

    hidden_size: int = 4096
    num_hidden_layers: int = 0
    intermediate_size: int = 21504
    num_attention_heads: int = 32
    vocab_size: int = 131072
    model_type: str = "nemotron_h"
    num_key_value_heads: int | None = 8
    head_dim: int | None = 128
    layers_block_type: list[str] | None = None
    hybrid_override_pattern: str | None = None  # older configs
    layer_norm_epsilon: float = 1e-5
    mlp_hidden_act: str = "relu2"
    mlp_bias: bool = False
    ssm_state_size: int = 128
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    mamba_hidden_act: str = "silu"
    n_groups: int = 8
    conv_kernel: int = 4
    use_conv_bias: bool = True
    chunk_size: int = 128
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    use_bias: bool = False
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 7688
    moe_shared_expert_intermediate_size: int = 7688
    moe_latent_size: int | None = None
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0

    default_rope_theta: ClassVar[float] = 10000.0  # unused: attention has no position embeddings

    @classmethod
    def from_dict(cls, params: dict) -> "ModelArgs":
        """Older configs' keys read as transformers does: an alias wins over its field; `layer_types` (the field's
        attribute_map name) stands for `layers_block_type`."""
        params = dict(params)
        for alias, name in ALIASES.items():
            if alias in params:
                params[name] = params.pop(alias)
        if "layers_block_type" not in params and params.get("layer_types") is not None:
            params["layers_block_type"] = params["layer_types"]
        return super().from_dict(params)

    def __post_init__(self):
        if self.layers_block_type is None:
            if self.hybrid_override_pattern is None:
                self.layers_block_type = [MAMBA, MOE, ATTENTION, MLP]  # transformers' default
            else:
                unknown = sorted(set(self.hybrid_override_pattern) - set(PATTERN))
                if unknown:
                    raise UnsupportedModelError(
                        f"nemotron_h hybrid_override_pattern blocks {unknown} are not supported"
                    )
                self.layers_block_type = [PATTERN[c] for c in self.hybrid_override_pattern]
        unknown = sorted(set(self.layers_block_type) - set(PATTERN.values()))
        if unknown:
            raise UnsupportedModelError(f"nemotron_h layers_block_type {unknown} are not supported")
        self.num_hidden_layers = len(self.layers_block_type)
        super().__post_init__()
        self.rms_norm_eps = self.layer_norm_epsilon
        for key, value, supported in (
            ("mlp_hidden_act", self.mlp_hidden_act, "relu2"),
            ("mamba_hidden_act", self.mamba_hidden_act, "silu"),
        ):
            if value != supported:
                raise UnsupportedModelError(f"nemotron_h {key} '{value}' is not supported (only '{supported}')")
        if self.mamba_num_heads % self.n_groups:
            raise UnsupportedModelError(
                f"nemotron_h: mamba_num_heads {self.mamba_num_heads} is not a multiple of n_groups {self.n_groups}"
            )


def relu2(x: mx.array) -> mx.array:
    """transformers' ReLUSquaredActivation: relu(x)^2."""
    return mx.square(nn.relu(x))


class GatedGroupNorm(nn.Module):
    """NemotronHRMSNormGated (norm_before_gate=False): RMSNorm over each group of `group_size` channels of
    x * silu(gate), in float32, times weight."""

    def __init__(self, dims: int, group_size: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.group_size, self.eps = group_size, eps

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        gate = gate.astype(mx.float32)
        x = x.astype(mx.float32) * (gate * mx.sigmoid(gate))
        groups = x.reshape(*x.shape[:-1], -1, self.group_size)
        normed = groups * mx.rsqrt(mx.mean(groups * groups, axis=-1, keepdims=True) + self.eps)
        return self.weight * normed.reshape(x.shape)


class Mamba2Mixer(nn.Module):
    """NemotronHMamba2Mixer: see the module docstring."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_heads, self.head_dim = args.mamba_num_heads, args.mamba_head_dim
        self.n_groups, self.state_size = args.n_groups, args.ssm_state_size
        self.inner = self.num_heads * self.head_dim
        self.conv_dim = self.inner + 2 * self.n_groups * self.state_size
        self.kernel, self.chunk = args.conv_kernel, args.chunk_size
        self.dt_limit = tuple(float(v) for v in args.time_step_limit)
        self.conv1d = DepthwiseConv(self.conv_dim, self.kernel, args.use_conv_bias)
        self.in_proj = nn.Linear(args.hidden_size, self.inner + self.conv_dim + self.num_heads, bias=args.use_bias)
        self.dt_bias = mx.ones((self.num_heads,))
        self.A_log = mx.zeros((self.num_heads,))
        self.D = mx.ones((self.num_heads,))
        self.norm = GatedGroupNorm(self.inner, self.inner // self.n_groups, args.layer_norm_epsilon)
        self.out_proj = nn.Linear(self.inner, args.hidden_size, bias=args.use_bias)

    def __call__(self, x: mx.array, cache: RecurrentCache | None, last_only: bool = False) -> mx.array:
        """`cache` holds the rows' state ([conv inputs, scan state]); `last_only` (a prompt's last chunk): the state
        takes every position, the output is the last position's only."""
        batch, L, _ = x.shape
        state = None if cache is None else cache.recurrent_state()
        conv_state, ssm_state = (None, None) if state is None else state
        gate, xbc, dt = mx.split(self.in_proj(x), [self.inner, self.inner + self.conv_dim], axis=-1)
        xbc, conv_state = causal_conv1d(
            zero_padding(xbc, cache), conv_state, self.conv1d.weight, self.conv1d.get("bias")
        )
        xbc = zero_padding(nn.silu(xbc), cache)  # padded columns leave the scan's zero state as it is
        h, B, C = mx.split(xbc, [self.inner, self.inner + self.n_groups * self.state_size], axis=-1)
        h = h.reshape(batch, L, self.num_heads, self.head_dim)
        B, C = (t.reshape(batch, L, self.n_groups, self.state_size) for t in (B, C))
        dt = nn.softplus(dt.astype(mx.float32) + self.dt_bias.astype(mx.float32))
        A = -mx.exp(self.A_log.astype(mx.float32))
        prompt = getattr(cache, "prompt_tokens", False)
        decoding = ssm_state is not None and not prompt and (getattr(cache, "decode_tokens", False) or L == 1)
        if decoding and L == 1:
            y, ssm_state = ssd_step(h, dt, A, B, C, self.D, ssm_state)
        elif decoding:  # generated tokens: the decode step's maths, several positions at once
            y, ssm_state = ssd_chunked(h, dt, A, B, C, self.D, ssm_state, self.chunk)
        else:  # prompt tokens: dt clamped to time_step_limit, as transformers' chunked scan
            y, ssm_state = ssd_chunked(h, self._limited(dt), A, B, C, self.D, ssm_state, self.chunk)
        if cache is not None:
            cache.update_state([conv_state, ssm_state], L)
        if last_only:
            y, gate = y[:, -1:], gate[:, -1:]
        y = self.norm(y.reshape(batch, y.shape[1], -1), gate)
        return self.out_proj(y.astype(x.dtype))

    def _limited(self, dt: mx.array) -> mx.array:
        low, high = self.dt_limit
        if low > 0.0:
            dt = mx.maximum(dt, low)
        return dt if high == float("inf") else mx.minimum(dt, high)

    def state_parts(self) -> tuple:
        """The per-row state this layer keeps (base.state_layout): the convolution's inputs (activations' dtype) and
        the scan's float32 state."""
        return ((self.kernel - 1, self.conv_dim), None), ((self.num_heads, self.head_dim, self.state_size), mx.float32)


class ReluSquaredMLP(nn.Module):
    """NemotronHMLP: down(relu(up(x))^2)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool):
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(relu2(self.up_proj(x)))


class SwitchMLP(nn.Module):
    """NemotronHExperts stacked (mlx-lm's names): fc2(relu(fc1(x))^2) for each of a token's k experts."""

    def __init__(self, input_dims: int, intermediate_size: int, num_experts: int):
        super().__init__()
        self.fc1 = SwitchLinear(input_dims, intermediate_size, num_experts)
        self.fc2 = SwitchLinear(intermediate_size, input_dims, num_experts)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """x [..., D], indices [..., k] -> [..., k, D] (rows grouped by expert when there are many, moe.SwitchGLU)."""
        lead, k = indices.shape[:-1], indices.shape[-1]
        x = mx.expand_dims(x, (-2, -3))
        do_sort = indices.size >= SORT_THRESHOLD
        if do_sort:
            flat = indices.flatten()
            order = mx.argsort(flat)
            inverse = mx.argsort(order)
            x = x.reshape(-1, 1, x.shape[-1])[order // k]
            indices = flat[order]
        y = self.fc2(relu2(self.fc1(x, indices, do_sort)), indices, do_sort)
        if do_sort:
            y = y[inverse].reshape(*lead, k, 1, y.shape[-1])
        return y.squeeze(-2)


class NemotronMoe(nn.Module):
    """NemotronHMoE: routed relu^2 experts (in the latent space when `moe_latent_size`) plus the shared MLP."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate = GroupedTopKRouter(
            args.hidden_size,
            args.n_routed_experts,
            args.num_experts_per_tok,
            args.n_group,
            args.topk_group,
            args.norm_topk_prob,
            args.routed_scaling_factor,
        )
        latent = args.moe_latent_size
        self.switch_mlp = SwitchMLP(latent or args.hidden_size, args.moe_intermediate_size, args.n_routed_experts)
        self.shared_experts = ReluSquaredMLP(args.hidden_size, args.moe_shared_expert_intermediate_size, args.mlp_bias)
        self.latent = latent is not None
        if self.latent:
            self.fc1_latent_proj = nn.Linear(args.hidden_size, latent, bias=args.mlp_bias)
            self.fc2_latent_proj = nn.Linear(latent, args.hidden_size, bias=args.mlp_bias)

    def __call__(self, x: mx.array) -> mx.array:
        indices, weights = self.gate(x)
        routed = self.fc1_latent_proj(x) if self.latent else x
        y = self.switch_mlp(routed, indices)
        y = (y * weights[..., None]).sum(axis=-2).astype(y.dtype)
        if self.latent:
            y = self.fc2_latent_proj(y)
        return y + self.shared_experts(x)


class NemotronHBlock(nn.Module):
    """x + mixer(norm(x)) with the block type's mixer."""

    def __init__(self, args: ModelArgs, block_type: str):
        super().__init__()
        self.block_type = block_type
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.layer_norm_epsilon)
        if block_type == MAMBA:
            self.mixer = Mamba2Mixer(args)
        elif block_type == ATTENTION:
            self.mixer = Attention(args, NoPE())
        elif block_type == MOE:
            self.mixer = NemotronMoe(args)
        else:
            self.mixer = ReluSquaredMLP(args.hidden_size, args.intermediate_size, args.mlp_bias)

    def __call__(self, x: mx.array, cache, last_only: bool = False) -> mx.array:
        """`last_only`: the last position's output only (every position's keys, values or state kept)."""
        if self.block_type == ATTENTION:
            return self.mixer(x, cache, residual=x, norm=self.norm, last_only=last_only)
        if self.block_type == MAMBA:
            h = self.mixer(self.norm(x), cache, last_only=last_only)
        else:  # position-wise: the other positions are not needed
            h = self.mixer(self.norm(x[:, -1:] if last_only else x))
        return (x[:, -1:] if last_only else x) + h


class NemotronHModel(nn.Module):
    """embeddings -> blocks -> norm_f (the checkpoint's `model.` / `backbone.`)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [NemotronHBlock(args, kind) for kind in args.layers_block_type]
        self.norm_f = nn.RMSNorm(args.hidden_size, eps=args.layer_norm_epsilon)

    def __call__(self, inputs: mx.array, cache, last_only: bool = False) -> mx.array:
        h = self.embeddings(inputs)
        caches = cache or [None] * len(self.layers)
        last = len(self.layers) - 1
        for i, (layer, layer_cache) in enumerate(zip(self.layers, caches)):
            h = layer(h, layer_cache, last_only=last_only and i == last)
        return self.norm_f(h)


class Model(nn.Module):
    """The causal LM (base.CausalLM): `model` plus `lm_head` (or the tied embedding)."""

    # Prompt tokens clamp dt, decode steps do not: what a sequence computed while generating is not what a prompt of
    # the same tokens computes, so the paged prefix cache keeps prompts only (engine/state_snapshots.py).
    decode_differs_from_prompt = True

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = NemotronHModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.max_context_length = args.max_position_embeddings

    def __call__(self, inputs: mx.array, cache=None, last_only: bool = False) -> mx.array:
        h = self.model(inputs, cache, last_only)
        if self.args.tie_word_embeddings:
            return self.model.embeddings.as_linear(h)
        return self.lm_head(h)

    @property
    def layers(self):
        return self.model.layers

    def kv_layout(self) -> list[tuple[int, int] | None]:
        """Keys and values only in the attention blocks (base.kv_layout)."""
        kv = (self.args.num_key_value_heads, self.args.head_dim)
        return [kv if layer.block_type == ATTENTION else None for layer in self.layers]

    def state_layout(self) -> list[tuple | None]:
        """A recurrent state in the Mamba2 blocks (base.state_layout)."""
        return [layer.mixer.state_parts() if layer.block_type == MAMBA else None for layer in self.layers]

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """`backbone.` -> `model.`; multi-token prediction layers (`mtp.*`) dropped; experts stacked as
        `switch_mlp.fc1` / `fc2`; conv1d weights in MLX's [C, K, 1] layout back to [C, 1, K]."""
        out = {}
        for name, value in weights.items():
            if name.startswith("mtp.") or "rotary_emb.inv_freq" in name:
                continue
            name = "model." + name[len("backbone.") :] if name.startswith("backbone.") else name
            if name.endswith("conv1d.weight") and value.shape[-1] == 1 and value.shape[1] != 1:
                value = mx.moveaxis(value, 2, 1)
            out[name] = value
        if self.args.tie_word_embeddings:
            out.pop("lm_head.weight", None)
        for i, layer in enumerate(self.layers):
            if layer.block_type == MOE:
                stack_experts(out, f"model.layers.{i}.mixer", self.args.n_routed_experts)
        return drop_extra_layers(out, len(self.layers))


def stack_experts(weights: dict[str, mx.array], prefix: str, num_experts: int) -> None:
    """`{prefix}.experts.{e}.{up,down}_proj.weight` (per expert) or `{prefix}.experts.{up,down}_proj` ([E, out, in])
    -> `{prefix}.switch_mlp.{fc1,fc2}.weight`, in place; already stacked names pass."""
    for hf_name, ours in (("up_proj", "fc1"), ("down_proj", "fc2")):
        stacked = weights.pop(f"{prefix}.experts.{hf_name}", None)
        keys = [f"{prefix}.experts.{e}.{hf_name}.weight" for e in range(num_experts)]
        if stacked is None and all(key in weights for key in keys):
            stacked = mx.stack([weights.pop(key) for key in keys])
        if stacked is not None:
            weights[f"{prefix}.switch_mlp.{ours}.weight"] = stacked
