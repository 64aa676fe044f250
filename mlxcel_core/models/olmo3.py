"""OLMo 3. Definition follows transformers' modeling_olmo3.py / configuration_olmo3.py (Olmo3ForCausalLM).

Differences from Qwen3, its nearest relative here:
- post-norm layers (as OLMo 2): no input norm; the attention's and the MLP's outputs are RMS-normed before their
  residual add (`post_attention_layernorm`, `post_feedforward_layernorm`);
- q_norm / k_norm are RMSNorms over the whole q / k projection (weights [heads * head_dim], one RMS over all heads),
  applied before the heads are split and rotated (Qwen3 norms each head);
- `layer_types` (default: three sliding-window layers, then a full one): sliding layers attend to the last
  `sliding_window` keys;
- one RoPE per layer type. transformers 5 writes `rope_parameters` keyed by layer type; an older config's
  `rope_scaling` (YaRN on the released checkpoints) applies to the full-attention layers only, sliding layers
  keep the default RoPE.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn

from ..errors import UnsupportedModelError
from .base import LayerCache
from .qwen2 import layer_windows
from .rope import RoPE, initialize_rope, rope_base, rope_scaling_config
from .transformer import Attention, DecoderLayer, GatedMLP, TransformerArgs, TransformerLM, heads_first

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass
class ModelArgs(TransformerArgs):
    """Defaults are Olmo3Config's (transformers writes them all, but hand-made configs may omit some)."""

    hidden_size: int = 4096
    num_hidden_layers: int = 32
    intermediate_size: int = 11008
    num_attention_heads: int = 32
    vocab_size: int = 50304
    model_type: str = "olmo3"
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    sliding_window: int | None = 4096
    attention_bias: bool = False
    layer_types: list[str] | None = None

    default_rope_theta: ClassVar[float] = 500000.0  # Olmo3Config.default_theta

    def __post_init__(self):
        rope_scaling = self.rope_scaling  # as config.json has it (TransformerArgs rewrites the field)
        super().__post_init__()
        if self.layer_types is None:
            self.layer_types = [SLIDING if (i + 1) % 4 else FULL for i in range(self.num_hidden_layers)]
        self.windows = layer_windows(self.num_hidden_layers, True, self.sliding_window, 0, self.layer_types)
        self.ropes = self.rope_per_layer_type(rope_scaling)

    def rope_per_layer_type(self, rope_scaling: dict | None) -> dict[str, dict[str, Any]]:
        """Each layer type's RoPE parameters, as Olmo3Config.convert_rope_params_to_dict resolves them: an older
        config's `rope_scaling` updates the full-attention entry, which takes `rope_theta` when it has none; the
        sliding entry defaults to 500000 even then (transformers 5.24 pops `rope_theta` once, for the full entry)."""
        params = self.rope_parameters or {}
        if params and SLIDING not in params and FULL not in params:
            raise UnsupportedModelError(
                "olmo3 rope_parameters must be keyed by layer type (sliding_attention / full_attention); "
                "transformers ignores a flat dict there"
            )
        ropes = {kind: dict(params.get(kind) or {"rope_type": "default"}) for kind in (SLIDING, FULL)}
        if rope_scaling:
            ropes[FULL].update(rope_scaling)
        theta = self.rope_theta if self.rope_theta is not None else self.default_rope_theta
        ropes[FULL].setdefault("rope_theta", theta)
        ropes[SLIDING].setdefault("rope_theta", self.default_rope_theta)
        return ropes


def make_rope(args: ModelArgs, layer_type: str) -> RoPE:
    params = args.ropes[layer_type]
    return initialize_rope(
        args.head_dim,
        rope_base(None, params),
        False,
        rope_scaling_config(None, params),
        max_position_embeddings=args.max_position_embeddings,
    )


class Olmo3Attention(Attention):
    """Attention with RMSNorms over the whole q and k projections (before the per-head split and RoPE)."""

    def __init__(self, args: ModelArgs, rope: RoPE, window: int | None):
        super().__init__(args, rope, bias=args.attention_bias, window=window)
        self.q_norm = nn.RMSNorm(self.n_heads * self.head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.n_kv_heads * self.head_dim, eps=args.rms_norm_eps)
        self.qk_norm = True  # q and k are normed between projection and rotation (a fused launch cannot rotate)

    def project_rotated(
        self, x: mx.array, norm: nn.Module | None, offset: int | mx.array
    ) -> tuple[mx.array, mx.array, mx.array]:
        q, k, v = self.project(x, norm)
        q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (heads_first(t, n) for t, n in ((q, self.n_heads), (k, self.n_kv_heads), (v, self.n_kv_heads)))
        return self.rope(q, offset), self.rope(k, offset), v


class Olmo3DecoderLayer(DecoderLayer):
    """Post-norm residual layer: h = x + norm(attn(x)); out = h + norm(mlp(h)) (no input norm)."""

    def __init__(self, args: ModelArgs, self_attn: Attention, mlp: nn.Module):
        super().__init__(args, self_attn, mlp)
        del self.input_layernorm
        self.post_feedforward_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, cache: LayerCache | None, last_only: bool = False) -> mx.array:
        """`last_only`: the last position's output only, every position's keys and values cached."""
        attended = self.self_attn(x, cache, last_only=last_only)
        h = (x[:, -1:, :] if last_only else x) + self.post_attention_layernorm(attended)
        return h + self.post_feedforward_layernorm(self.mlp(h))


class Model(TransformerLM):
    def __init__(self, args: ModelArgs):
        ropes = {kind: make_rope(args, kind) for kind in sorted(set(args.layer_types))}
        layers = [
            Olmo3DecoderLayer(
                args,
                Olmo3Attention(args, ropes[kind], window),
                GatedMLP(args.hidden_size, args.intermediate_size),
            )
            for kind, window in zip(args.layer_types, args.windows)
        ]
        super().__init__(args, layers)
