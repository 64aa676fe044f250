"""Gemma 4 text (`gemma4_text`; the language model of the image/audio-text `gemma4` checkpoints: E2B, E4B, 31B and
the 26B-A4B MoE). Definition follows transformers' modeling_gemma4.py (Gemma4ForCausalLM / Gemma4TextModel) and
configuration_gemma4.py (Gemma4TextConfig); the layers are in gemma4_layers.py.

Against Gemma 3: sliding and full layers differ in head size (`global_head_dim`) and, with `attention_k_eq_v`, in KV
heads (`num_global_key_value_heads`); each type has its RoPE (`rope_parameters` by layer type; full layers' default
is "proportional": only the first `partial_rotary_factor` of each half of a head rotates, with frequencies of the
whole head size); per-layer embeddings (PLE: a second embedding table holding a `hidden_size_per_layer_input` slice
per layer, plus a projection of the main embedding, normed and mixed 1:1) feed each layer; the last
`num_kv_shared_layers` layers compute no keys or values and attend over those of the last earlier layer of their type
(`kv_sources`; their caches stay empty: `kv_layout` says so to the engine); the MoE variant runs experts beside
each layer's dense MLP.

transformers 5 writes the per-type head sizes as `per_layer_config` (layer index -> overrides); released configs
write `global_head_dim` and `num_global_key_value_heads`; both are read. A multimodal config.json nests this config
under `text_config` (loading/hf.py flattens it and says so); the text weights live under `model.language_model.` (or
mlx-lm's `language_model.model.`) and sanitize drops the vision and audio towers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..errors import UnsupportedModelError
from .activations import softcap
from .base import BaseModelArgs, cache_offset
from .gemma4_layers import FULL, SLIDING, Gemma4DecoderLayer
from .gemma_common import GELU_TANH, text_tower_weights
from .moe import stack_experts
from .rope import RoPE
from .transformer import times

ABSENT = "absent"  # per_layer_config not in config.json (transformers then derives it from global_head_dim)
DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
# The multimodal checkpoints' other towers (transformers 5 keeps them under `model.`, mlx-lm at the top level).
TOWERS = ("vision_tower.", "audio_tower.", "embed_vision.", "embed_audio.", "multi_modal_projector.")
DROPPED = tuple(prefix + tower for prefix in ("", "model.") for tower in TOWERS)
SHARED_LAYER_WEIGHTS = ("k_proj.", "v_proj.", "k_norm.", "v_norm.")  # released checkpoints may keep them


@dataclass
class ModelArgs(BaseModelArgs):
    """Defaults are transformers' Gemma4TextConfig defaults (hub configs omit them)."""

    model_type: str = "gemma4_text"
    vocab_size: int = 262_144
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 30
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    global_head_dim: int = 512
    num_global_key_value_heads: int | None = None
    per_layer_config: Any = ABSENT
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 131_072
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    rope_parameters: dict[str, Any] | None = None
    attention_bias: bool = False
    sliding_window: int = 512
    layer_types: list[str] | None = None
    final_logit_softcapping: float | None = None
    use_bidirectional_attention: str | None = None
    vocab_size_per_layer_input: int = 262_144
    hidden_size_per_layer_input: int | None = 256
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    enable_moe_block: bool = False
    use_double_wide_mlp: bool = False
    num_experts: int | None = None
    top_k_experts: int | None = None
    moe_intermediate_size: int | None = None

    def __post_init__(self):
        self._check_supported()
        if self.layer_types is None:  # 5 sliding layers per full one
            self.layer_types = [SLIDING if (i + 1) % 6 else FULL for i in range(self.num_hidden_layers)]
        self.layer_types = list(self.layer_types)
        unknown = sorted(set(self.layer_types) - {SLIDING, FULL})
        if unknown or len(self.layer_types) != self.num_hidden_layers:
            raise UnsupportedModelError(
                f"{self.model_type} layer_types {unknown or self.layer_types} are not supported"
            )
        self.layer_types[-1] = FULL  # as Gemma4TextConfig: the last layer attends globally, whatever config.json says
        self.rope_parameters = self.rope_parameters or DEFAULT_ROPE
        self.layer_shapes = self._layer_shapes()
        self.kv_sources = self._kv_sources()

    def _check_supported(self) -> None:
        if self.hidden_activation not in GELU_TANH:
            raise UnsupportedModelError(
                f"hidden_activation '{self.hidden_activation}' is not supported for {self.model_type}"
            )
        if self.use_bidirectional_attention == "all":
            raise UnsupportedModelError(f"{self.model_type} with use_bidirectional_attention 'all' is not causal")
        if self.enable_moe_block and None in (self.num_experts, self.top_k_experts, self.moe_intermediate_size):
            raise UnsupportedModelError(
                f"{self.model_type} enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size"
            )
        if not 0 <= self.num_kv_shared_layers < self.num_hidden_layers:
            raise UnsupportedModelError(
                f"{self.model_type} num_kv_shared_layers {self.num_kv_shared_layers} is not supported: some of the "
                f"{self.num_hidden_layers} layers must compute their own keys and values"
            )

    def _layer_shapes(self) -> list[tuple[int, int]]:
        """(head_dim, num_key_value_heads) per layer, as Gemma4TextConfig's per_layer_config resolves them: the
        config's own `per_layer_config`, else full layers get `global_head_dim` (and, with attention_k_eq_v,
        `num_global_key_value_heads`)."""
        overrides = self.per_layer_config
        if overrides == ABSENT:
            full = {"head_dim": self.global_head_dim}
            if self.attention_k_eq_v and self.num_global_key_value_heads is not None:
                full["num_key_value_heads"] = self.num_global_key_value_heads
            overrides = {i: full for i, kind in enumerate(self.layer_types) if kind == FULL}
        overrides = {int(i): dict(o) for i, o in (overrides or {}).items()}
        for i, layer in overrides.items():
            extra = sorted(set(layer) - {"head_dim", "num_key_value_heads"})
            if extra or not 0 <= i < self.num_hidden_layers:
                raise UnsupportedModelError(
                    f"{self.model_type} per_layer_config of layer {i} ({', '.join(extra) or 'out of range'}) is not "
                    "supported (supported: head_dim, num_key_value_heads)"
                )
        shapes = []
        for i in range(self.num_hidden_layers):
            layer = overrides.get(i, {})
            shapes.append(
                (layer.get("head_dim", self.head_dim), layer.get("num_key_value_heads", self.num_key_value_heads))
            )
        for kind in set(self.layer_types):
            if len({s for s, t in zip(shapes, self.layer_types) if t == kind}) > 1:
                raise UnsupportedModelError(
                    f"{self.model_type} {kind} layers of different head sizes are not supported"
                )
        return shapes

    def _kv_sources(self) -> list[int]:
        """Per layer, the layer whose keys and values it attends over (Gemma4TextConfig.kv_sharing_modes): itself,
        or for the last num_kv_shared_layers layers the last earlier layer of its type."""
        first_shared = self.num_hidden_layers - self.num_kv_shared_layers
        last_of_type = {kind: i for i, kind in enumerate(self.layer_types[:first_shared])}
        sources = list(range(first_shared))
        for kind in self.layer_types[first_shared:]:
            if kind not in last_of_type:
                raise UnsupportedModelError(
                    f"{self.model_type} KV-shared {kind} layers have no earlier {kind} layer to take keys from"
                )
            sources.append(last_of_type[kind])
        return sources

    def head_dim_of(self, layer: int) -> int:
        return self.layer_shapes[layer][0]

    def kv_heads_of(self, layer: int) -> int:
        return self.layer_shapes[layer][1]

    def kv_source(self, layer: int) -> int:
        return self.kv_sources[layer]

    def mlp_width_of(self, layer: int) -> int:
        """intermediate_size, doubled for KV-shared layers with use_double_wide_mlp."""
        doubled = self.use_double_wide_mlp and self.kv_sources[layer] != layer
        return self.intermediate_size * (2 if doubled else 1)

    def rope_of(self, layer_type: str) -> RoPE:
        """The layer type's RoPE over its whole head (Gemma4TextRotaryEmbedding): "default" (its partial factor
        ignored, as transformers' Gemma 4 default does) or "proportional"."""
        params = self.rope_parameters.get(layer_type) if isinstance(self.rope_parameters, dict) else None
        if not isinstance(params, dict) or "rope_theta" not in params:
            raise UnsupportedModelError(f"{self.model_type} rope_parameters has no rope_theta for {layer_type} layers")
        kind, base = params.get("rope_type", "default"), float(params["rope_theta"])
        dims = self.head_dim_of(self.layer_types.index(layer_type))
        if kind == "default":
            return RoPE(dims, base)
        if kind == "proportional":
            return RoPE(dims, base, inv_freq=proportional_inv_freq(dims, base, params))
        raise UnsupportedModelError(
            f"{self.model_type} rope_type '{kind}' of {layer_type} layers is not supported (supported: default, "
            "proportional)"
        )


def proportional_inv_freq(head_dim: int, base: float, params: dict[str, Any]) -> mx.array:
    """transformers' _compute_proportional_rope_parameters: the first partial_rotary_factor * head_dim / 2 frequencies
    as the default RoPE's over the whole head size, the rest 0 (those dimensions do not rotate), all / `factor`."""
    angles = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
    rotated = 1.0 / (base ** (mx.arange(0, 2 * angles, 2, dtype=mx.float32) / head_dim))
    inv_freq = mx.concatenate([rotated, mx.zeros((head_dim // 2 - angles,), mx.float32)])
    return inv_freq / float(params.get("factor", 1.0))


class Gemma4TextModel(nn.Module):
    """Gemma4TextModel: scaled embeddings, per-layer inputs, the layers (KV-shared ones reading their source's cache),
    final norm (the checkpoint's `model.`)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        ropes = {kind: args.rope_of(kind) for kind in set(args.layer_types)}
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [Gemma4DecoderLayer(args, i, ropes[kind]) for i, kind in enumerate(args.layer_types)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.per_layer_dims = args.hidden_size_per_layer_input or 0
        if self.per_layer_dims:
            width = args.num_hidden_layers * self.per_layer_dims
            self.embed_tokens_per_layer = nn.Embedding(args.vocab_size_per_layer_input, width)
            self.per_layer_model_projection = nn.Linear(args.hidden_size, width, bias=False)
            self.per_layer_projection_norm = nn.RMSNorm(self.per_layer_dims, eps=args.rms_norm_eps)
        self.first_shared = args.num_hidden_layers - args.num_kv_shared_layers

    def per_layer_inputs(self, inputs: mx.array, embedded: mx.array) -> mx.array:
        """[B, L, layers, per-layer dims]: get_per_layer_inputs + project_per_layer_inputs."""
        shape = (*inputs.shape, self.args.num_hidden_layers, self.per_layer_dims)
        tokens = self.embed_tokens_per_layer(inputs)
        tokens = (tokens * mx.array(self.per_layer_dims**0.5, dtype=tokens.dtype)).reshape(shape)
        projected = times(self.per_layer_model_projection(embedded), self.args.hidden_size**-0.5).reshape(shape)
        return times(self.per_layer_projection_norm(projected) + tokens, 2.0**-0.5)

    def __call__(self, inputs: mx.array, cache, last_only: bool = False) -> mx.array:
        """Hidden states [B, L, hidden]; `last_only`: [B, 1, hidden]. The KV-shared layers store nothing, so with
        `last_only` they run on the last position alone (transformers' _maybe_slice_kv_shared_inputs)."""
        h = self.embed_tokens(inputs)
        h = h * mx.array(self.args.hidden_size**0.5, dtype=h.dtype)  # rounded to the embedding dtype, as transformers
        per_layer = self.per_layer_inputs(inputs, h) if self.per_layer_dims else None
        caches = cache or [None] * len(self.layers)
        offset = cache_offset(caches[0])  # (layer 0 always stores: the position before any layer wrote this step)
        computed: dict[int, tuple[mx.array, mx.array]] = {}  # without caches: the storing layers' keys and values
        last = len(self.layers) - 1
        for i, (layer, source) in enumerate(zip(self.layers, self.args.kv_sources)):
            if last_only and i == self.first_shared and h.shape[1] > 1:
                offset = offset + h.shape[1] - 1
                h, per_layer = h[:, -1:], None if per_layer is None else per_layer[:, -1:]
            layer_input = None if per_layer is None else per_layer[:, :, i, :]
            h, kv = layer(h, caches[source], offset, layer_input, computed.get(source), last_only and i == last)
            if kv is not None:
                computed[i] = kv
        return self.norm(h)


class Model(nn.Module):
    """Gemma4ForCausalLM: the text model, the tied embedding (or `lm_head`) and the final soft-capping."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = Gemma4TextModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.max_context_length = args.max_position_embeddings
        self.kv_sources = args.kv_sources

    def __call__(self, inputs: mx.array, cache=None, last_only: bool = False) -> mx.array:
        h = self.model(inputs, cache, last_only)
        logits = self.model.embed_tokens.as_linear(h) if self.args.tie_word_embeddings else self.lm_head(h)
        if self.args.final_logit_softcapping:
            logits = softcap(logits, self.args.final_logit_softcapping)
        return logits

    @property
    def layers(self):
        return self.model.layers

    def kv_layout(self) -> list[tuple[int, int] | None]:
        """Per layer, (KV heads, head dim) of what its cache stores; None for a KV-shared layer (its cache stays
        empty: it reads its source layer's)."""
        return [
            (self.args.kv_heads_of(i), self.args.head_dim_of(i)) if source == i else None
            for i, source in enumerate(self.kv_sources)
        ]

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """The text tower's weights renamed, the other towers dropped, the KV-shared layers' unused k/v weights
        dropped, transformers' fused experts split into `experts.switch_glu`."""
        weights = text_tower_weights(weights, DROPPED)
        weights = {k: v for k, v in weights.items() if "rotary_emb" not in k and not self._unused(k)}
        if self.args.tie_word_embeddings:
            weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
        if self.args.enable_moe_block:
            for i in range(self.args.num_hidden_layers):
                prefix = f"model.layers.{i}"
                weights = stack_experts(weights, prefix, self.args.num_experts)
                for name in ("gate_proj", "up_proj", "down_proj"):
                    if f"{prefix}.switch_mlp.{name}.weight" in weights:
                        moved = weights.pop(f"{prefix}.switch_mlp.{name}.weight")
                        weights[f"{prefix}.experts.switch_glu.{name}.weight"] = moved
        return weights

    def _unused(self, name: str) -> bool:
        """A KV-shared layer's key/value weights (transformers ignores them at load too)."""
        parts = name.split(".")
        if len(parts) < 5 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
            return False
        layer = int(parts[2])
        return (
            layer < len(self.kv_sources)
            and self.kv_sources[layer] != layer
            and parts[3] == "self_attn"
            and (f"{parts[4]}." in SHARED_LAYER_WEIGHTS)
        )
