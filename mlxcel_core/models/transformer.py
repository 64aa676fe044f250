"""The decoder-only transformer every family is built from; each family module keeps only what differs.

A family module (one per model_type, as in mlx-lm) declares its config on `TransformerArgs` (Gemma has its
own), builds its attention from `Attention` (biases, q/k norms, scale, window, soft-capping and the RoPE
are arguments), its feed-forward block (`GatedMLP`, a fused variant or a MoE block) and its decoder layers
(`DecoderLayer`, or Gemma's sandwich-norm layer), and hands them to `TransformerLM`, which owns the
embeddings, the final norm, the LM head or tied embedding, `layers`, `max_context_length` and `sanitize`.

Attribute names are the checkpoints' parameter names (`model.layers.0.self_attn.q_proj.weight`, ...),
so Hugging Face and mlx-lm checkpoints load unchanged.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Protocol, runtime_checkable

import mlx.core as mx
import mlx.nn as nn

from ..errors import UnsupportedModelError
from .activations import swiglu
from .base import BaseModelArgs, LayerCache, attention, cache_offset, normed
from .rope import RoPE, rope_base, rope_scaling_config


@dataclass
class TransformerArgs(BaseModelArgs):
    """config.json fields the SiLU-gated families share (Llama, Qwen, Phi-3, Mixtral) and what they derive:
    KV heads default to the query heads, head_dim to hidden_size // heads, `rope_base` / `rope_scaling`
    from either transformers 4's or 5's keys. Families add fields and override defaults."""

    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    model_type: str = "llama"
    rms_norm_eps: float = 1e-6
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 4096
    rope_theta: float | None = None
    rope_parameters: dict[str, Any] | None = None
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None

    default_rope_theta: ClassVar[float] = 10000.0  # the family's transformers default when config.json has none

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.hidden_act != "silu":
            raise UnsupportedModelError(f"hidden_act '{self.hidden_act}' is not supported for {self.model_type}")
        self.rope_base = rope_base(self.rope_theta, self.rope_parameters, default=self.default_rope_theta)
        self.rope_scaling = rope_scaling_config(self.rope_scaling, self.rope_parameters)


@runtime_checkable
class AddsResidual(Protocol):
    """A projection that adds a residual to its output itself (a backend's layer that takes a decode step's o_proj or
    down_proj and the residual add into one kernel launch)."""

    def add_to(self, x: mx.array, residual: mx.array) -> mx.array: ...


@functools.cache
def adds_residual(cls: type) -> bool:
    """Whether layers of `cls` are AddsResidual. Asked once per class: a runtime Protocol's isinstance walks the
    protocol's members on every call (about 40 us on the CPU box), and an op-by-op decode step asks it twice a layer
    (2.4 ms a SmolLM2 token)."""
    return issubclass(cls, AddsResidual)


def add_projection(layer: nn.Module, x: mx.array, residual: mx.array | None) -> mx.array:
    """residual + layer(x) (layer(x) when residual is None): the residual connection around a block, taken into the
    block's output projection."""
    if residual is None:
        return layer(x)
    if adds_residual(type(layer)):
        return layer.add_to(x, residual)
    return residual + layer(x)


def times(x: mx.array, factor: float) -> mx.array:
    """x * factor as torch multiplies a tensor by a Python float: in float32, rounded once to x's dtype (MLX would
    round the factor to a bfloat16 / float16 x's dtype first). The same array op for a float32 x."""
    return (x * mx.array(factor, dtype=mx.float32)).astype(x.dtype)


def heads_first(x: mx.array, heads: int) -> mx.array:
    """[B, L, heads * D] -> [B, heads, L, D]. At L = 1 (a decode step) both layouts are the same memory, so it is one
    reshape, not a reshape and a transpose: a decode step's graph has an op fewer per tensor (the 1B step on a GPU is
    bound by the host's cost per op, benchmarks/host_profile.py)."""
    B, L, _ = x.shape
    if L == 1:
        return x.reshape(B, heads, 1, -1)
    return x.reshape(B, L, heads, -1).transpose(0, 2, 1, 3)


def heads_last(x: mx.array) -> mx.array:
    """[B, heads, L, D] -> [B, L, heads * D] (heads_first's inverse; one reshape at L = 1)."""
    B, H, L, D = x.shape
    if L == 1:
        return x.reshape(B, 1, H * D)
    return x.transpose(0, 2, 1, 3).reshape(B, L, H * D)


class Attention(nn.Module):
    """Grouped-query attention with RoPE over q/k/v/o projections (reads the head counts and head_dim from args).

    What families vary is an argument: projection biases (`o_bias` defaults to `bias`), per-head q/k norms
    (`qk_norm`, a norm class, applied before RoPE), the scale (default head_dim**-0.5), a sliding `window`,
    attention-logit `softcap`, attention `sinks` (gpt-oss: a learned logit per query head in the softmax's denominator,
    the checkpoint's `self_attn.sinks`). A fused checkpoint layout (Phi-3) overrides `init_projections` and `project`.
    `residual`: return residual + the block's output (add_projection); `norm`: the block's input is norm(x) (the
    pre-norm, handed down so that an override of `project` or `project_rotated` may apply it inside its own
    computation).
    """

    def __init__(
        self,
        args,
        rope: RoPE,
        *,
        bias: bool = False,
        o_bias: bool | None = None,
        window: int | None = None,
        scale: float | None = None,
        softcap: float | None = None,
        qk_norm: type[nn.Module] | None = None,
        sinks: bool = False,
    ):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = self.head_dim**-0.5 if scale is None else scale
        self.init_projections(args.hidden_size, bias, bias if o_bias is None else o_bias)
        self.qk_norm = qk_norm is not None
        if qk_norm is not None:
            self.q_norm = qk_norm(self.head_dim, eps=args.rms_norm_eps)
            self.k_norm = qk_norm(self.head_dim, eps=args.rms_norm_eps)
        self.rope = rope
        self.window = window  # None = full attention
        self.softcap = softcap
        if sinks:
            self.sinks = mx.zeros((self.n_heads,))

    def init_projections(self, hidden_size: int, bias: bool, o_bias: bool) -> None:
        self.q_proj = nn.Linear(hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, hidden_size, bias=o_bias)

    def project(self, x: mx.array, norm: nn.Module | None = None) -> tuple[mx.array, mx.array, mx.array]:
        """Queries, keys, values [B, L, heads * head_dim] of x, or of norm(x)."""
        x = normed(x, norm)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def project_rotated(
        self, x: mx.array, norm: nn.Module | None, offset: int | mx.array
    ) -> tuple[mx.array, mx.array, mx.array]:
        """Queries, keys, values [B, heads, L, head_dim] of x (of norm(x)), q and k normed per head (`qk_norm`) and
        rotated for positions from `offset` on: everything of the block before the attention itself."""
        q, k, v = self.project(x, norm)
        q, k, v = (heads_first(t, n) for t, n in ((q, self.n_heads), (k, self.n_kv_heads), (v, self.n_kv_heads)))
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.rope(q, offset), self.rope(k, offset), v

    def __call__(
        self,
        x: mx.array,
        cache: LayerCache | None,
        residual: mx.array | None = None,
        norm: nn.Module | None = None,
        last_only: bool = False,
    ) -> mx.array:
        """`last_only`: keys and values of every position go to the cache, but the output (and the residual) is the
        last position's only ([B, 1, hidden]): the last layer of a prompt whose LM head reads one position."""
        q, k, v = self.project_rotated(x, norm, cache_offset(cache))
        if last_only:  # one query, at the last position: the caches' masks align queries with the last keys
            q = q[:, :, -1:, :]
            residual = None if residual is None else residual[:, -1:, :]
        out = attention(q, k, v, cache, self.scale, window=self.window, softcap=self.softcap, sinks=self.get("sinks"))
        return add_projection(self.o_proj, heads_last(out), residual)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); act is the fused SwiGLU (SiLU families) or GeGLU (Gemma).
    `residual`: return residual + the block's output (add_projection); `norm`: the block's input is norm(x) (handed
    down so that an override of `project_gated` may apply it inside its own computation)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        activation: Callable[[mx.array, mx.array], mx.array] = swiglu,
    ):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.activation = activation

    def project_gated(self, x: mx.array, norm: nn.Module | None = None) -> mx.array:
        """act(gate(x)) * up(x) (of norm(x)): the down projection's input."""
        x = normed(x, norm)
        return self.activation(self.gate_proj(x), self.up_proj(x))

    def __call__(self, x: mx.array, residual: mx.array | None = None, norm: nn.Module | None = None) -> mx.array:
        return add_projection(self.down_proj, self.project_gated(x, norm), residual)


class DecoderLayer(nn.Module):
    """Pre-norm residual layer: h = x + attn(norm(x)); out = h + mlp(norm(h)), with RMSNorm.

    `mlp_name` is the feed-forward block's checkpoint name (Mixtral's is `block_sparse_moe`). Both blocks take the
    residual (`residual=`) and add it themselves, and their input's norm (`norm=`) and apply it themselves, so a
    block's implementation may compute the norm and the add together with its projections."""

    def __init__(self, args, self_attn: nn.Module, mlp: nn.Module, mlp_name: str = "mlp"):
        super().__init__()
        self.self_attn = self_attn
        self.mlp_name = mlp_name
        setattr(self, mlp_name, mlp)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, cache: LayerCache | None, last_only: bool = False) -> mx.array:
        """`last_only`: the last position's output only, every position's keys and values cached."""
        h = self.self_attn(x, cache, residual=x, norm=self.input_layernorm, last_only=last_only)
        return self[self.mlp_name](h, residual=h, norm=self.post_attention_layernorm)


class TransformerModel(nn.Module):
    """embed -> layers -> final norm (the checkpoint's `model.`); Gemma scales the embeddings by `embed_scale` (rounded
    to their dtype first), Granite by `embed_multiplier` (a Python float, `times`)."""

    def __init__(
        self,
        args,
        layers: list[nn.Module],
        norm: type[nn.Module] = nn.RMSNorm,
        embed_scale: float | None = None,
        embed_multiplier: float | None = None,
    ):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = layers
        self.norm = norm(args.hidden_size, eps=args.rms_norm_eps)
        self.embed_scale = embed_scale
        self.embed_multiplier = embed_multiplier

    def __call__(self, inputs: mx.array, cache, last_only: bool = False) -> mx.array:
        """Hidden states [B, L, hidden]; `last_only`: [B, 1, hidden], the last position's. Its last layer then runs
        attention output, MLP and norm for that position alone (its keys and values for all of them): a prompt's
        other positions feed only the discarded hidden states there."""
        h = self.embed_tokens(inputs)
        if self.embed_scale is not None:
            h = h * mx.array(self.embed_scale, dtype=h.dtype)  # rounded to the embedding dtype, as transformers
        if self.embed_multiplier is not None:
            h = times(h, self.embed_multiplier)
        caches = cache or [None] * len(self.layers)
        last = len(self.layers) - 1
        for i, (layer, layer_cache) in enumerate(zip(self.layers, caches)):
            h = layer(h, layer_cache, last_only=True) if last_only and i == last else layer(h, layer_cache)
        return self.norm(h)


class TransformerLM(nn.Module):
    """The causal LM the engine runs (base.CausalLM): `model` plus `lm_head`, or the tied embedding."""

    def __init__(self, args, layers: list[nn.Module], **model_options):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = TransformerModel(args, layers, **model_options)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.max_context_length = args.max_position_embeddings

    def __call__(self, inputs: mx.array, cache=None, last_only: bool = False) -> mx.array:
        h = self.model(inputs, cache, last_only)  # last_only: a prompt's last chunk; the LM head reads one position
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    @property
    def layers(self):
        return self.model.layers

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Drop what transformers saves but the model computes: rotary inv_freq, a tied LM head."""
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings:
            weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
        return weights
