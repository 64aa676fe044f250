"""Ministral 3 (text). Definition follows transformers' modeling_ministral3.py / configuration_ministral3.py
(Ministral3ForCausalLM, and the language model of Mistral3ForConditionalGeneration).

Differences from Mistral (llama.py): YaRN RoPE by default, and Llama 4's position-dependent query scaling: after
RoPE, the queries of position p are multiplied by 1 + beta * log(1 + floor(p / original)), with beta =
`llama_4_scaling_beta` and original = `original_max_position_embeddings` of the RoPE parameters (transformers'
get_llama_4_attn_scale). The scale depends on each row's absolute position, so it is computed from the cache's
offset, which is one position per row in a batch. `sliding_window`, when set, applies to every layer (transformers
ignores `layer_types` here).

The released checkpoints are image-text (`mistral3`): config.json nests this config under `text_config`
(loading/hf.py flattens it) and the weights live under `language_model.model.` or `model.language_model.`;
sanitize renames them and drops the vision tower and projector.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..errors import UnsupportedModelError
from .rope import RoPE, initialize_rope
from .transformer import Attention, DecoderLayer, GatedMLP, TransformerArgs, TransformerLM

# Multimodal (mistral3) layouts: transformers < 5 and mlx-vlm write `language_model.model.`, transformers 5 writes
# `model.language_model.` (as Gemma 3's, gemma_common.py).
_RENAMES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_DROPPED = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
_SCALED_ROPE = ("llama3", "yarn", "longrope")  # the types whose parameters carry original_max_position_embeddings


def default_rope_parameters(max_position_embeddings: int) -> dict:
    """Ministral3Config's RoPE when config.json has none."""
    return {
        "rope_type": "yarn",
        "rope_theta": 1000000.0,
        "factor": 16.0,
        "original_max_position_embeddings": 16384,
        "max_position_embeddings": max_position_embeddings,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale_all_dim": 1.0,
        "mscale": 1.0,
        "llama_4_scaling_beta": 0.1,
    }


@dataclass
class ModelArgs(TransformerArgs):
    """Defaults are Ministral3Config's (the 8B)."""

    hidden_size: int = 4096
    num_hidden_layers: int = 34
    intermediate_size: int = 14336
    num_attention_heads: int = 32
    vocab_size: int = 131072
    model_type: str = "ministral3"
    rms_norm_eps: float = 1e-5
    num_key_value_heads: int | None = 8
    head_dim: int | None = 128
    max_position_embeddings: int = 262144

    def __post_init__(self):
        # As PreTrainedConfig.convert_rope_params_to_dict: an older config's rope_scaling replaces rope_parameters,
        # rope_theta fills in the base; then standardize_rope_params fills the pretraining length.
        rope = dict(self.rope_scaling or self.rope_parameters or default_rope_parameters(self.max_position_embeddings))
        rope.setdefault("rope_theta", self.rope_theta if self.rope_theta is not None else self.default_rope_theta)
        rope.setdefault("rope_type", rope.get("type", "default"))
        if rope["rope_type"] in _SCALED_ROPE:
            rope.setdefault("original_max_position_embeddings", self.max_position_embeddings)
        self.rope_parameters, self.rope_scaling = rope, None
        super().__post_init__()
        self.query_scaling_beta = rope.get("llama_4_scaling_beta")
        self.query_scaling_length = rope.get("original_max_position_embeddings")
        if self.query_scaling_beta is None or self.query_scaling_length is None:
            raise UnsupportedModelError(
                "ministral3 needs llama_4_scaling_beta and original_max_position_embeddings in its rope_parameters "
                "(the position-dependent query scaling)"
            )


def query_scale(offset: int | mx.array, length: int, beta: float, original: int) -> mx.array:
    """1 + beta * log(1 + floor(p / original)) for the positions p of `length` queries from `offset` (an int, or one
    per batch row), float32 [rows or 1, 1, length, 1]. A left-padded row's pad columns have negative positions: they
    count as 0 (their queries are discarded; transformers gives pad positions 1)."""
    start = offset[..., None] if isinstance(offset, mx.array) else offset
    positions = mx.maximum(mx.arange(length) + start, 0).astype(mx.float32)
    scale = 1 + beta * mx.log(1 + mx.floor(positions / original))
    return scale.reshape(-1, 1, length, 1)


class Ministral3Attention(Attention):
    """Attention whose rotated queries are scaled by their position (query_scale)."""

    def __init__(self, args: ModelArgs, rope: RoPE):
        super().__init__(args, rope, window=args.sliding_window)
        self.query_scaling = (float(args.query_scaling_beta), int(args.query_scaling_length))

    def project_rotated(
        self, x: mx.array, norm: nn.Module | None, offset: int | mx.array
    ) -> tuple[mx.array, mx.array, mx.array]:
        q, k, v = super().project_rotated(x, norm, offset)
        beta, original = self.query_scaling
        length = q.shape[2]
        if beta == 0 or (isinstance(offset, int) and offset + length <= original):
            return q, k, v  # every scale is exactly 1
        return q * query_scale(offset, length, beta, original).astype(q.dtype), k, v


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
            DecoderLayer(args, Ministral3Attention(args, rope), GatedMLP(args.hidden_size, args.intermediate_size))
            for _ in range(args.num_hidden_layers)
        ]
        super().__init__(args, layers)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Image-text checkpoints: the language model's weights renamed, the vision tower's and projector's dropped.
        FP8 checkpoints (per-tensor `weight_scale_inv`) are refused."""
        out = {}
        for name, value in weights.items():
            if name.endswith(("weight_scale_inv", "activation_scale")):
                raise UnsupportedModelError(
                    "FP8-quantized ministral3 checkpoints (weight_scale_inv tensors) are not supported: "
                    "use the BF16 release or an MLX-quantized copy"
                )
            for old, new in _RENAMES:
                if name.startswith(old):
                    name = new + name[len(old) :]
                    break
            if not name.startswith(_DROPPED):
                out[name] = value
        return super().sanitize(out)
