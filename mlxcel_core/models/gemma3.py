"""Gemma 3 text (also the text tower of image-text Gemma 3 checkpoints).

Definition follows transformers' modeling_gemma3.py (Gemma3ForCausalLM / Gemma3TextModel). Differences
from Gemma 2 on top of the shared layers (gemma_common): RMS-normalized queries and keys per head, no
attention soft-capping (transformers ignores `attn_logit_softcapping` here), five sliding layers per
global one by default, and two RoPEs: sliding layers use the local base (`rope_local_base_freq`, 10k),
global layers the global base (`rope_theta`, 1M) with the checkpoint's scaling (e.g. linear x8).
transformers 5 writes both as `rope_parameters` keyed by layer type.

A multimodal config.json nests this config under `text_config` (loading/hf.py flattens it) and its
weights live under `language_model.model.` or `model.language_model.`; sanitize renames them and drops
the vision tower and projector.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .gemma_common import FULL, SLIDING, GemmaArgs, GemmaCausalLM
from .rope import initialize_rope, rope_base, rope_scaling_config


@dataclass
class ModelArgs(GemmaArgs):
    """Defaults are transformers' Gemma3TextConfig defaults (multimodal configs omit most of them)."""

    model_type: str = "gemma3_text"
    vocab_size: int = 262208
    max_position_embeddings: int = 131072
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    sliding_window_pattern: int = 6
    rope_local_base_freq: float | None = None

    def default_layer_types(self) -> list[str]:
        return [SLIDING if (i + 1) % self.sliding_window_pattern else FULL for i in range(self.num_hidden_layers)]

    def rope_for(self, layer_type: str) -> dict[str, Any]:
        """One layer type's RoPE parameters, as Gemma3TextConfig.convert_rope_params_to_dict resolves them."""
        params = self.rope_parameters or {}
        if SLIDING in params or FULL in params:
            per_type = dict(params.get(layer_type) or {})
        elif layer_type == FULL:  # a flat dict describes the global RoPE
            per_type = dict(params)
        else:
            per_type = {}
        per_type.setdefault("rope_type", "default")
        if layer_type == FULL:
            if self.rope_scaling:
                per_type.update(self.rope_scaling)
            per_type.setdefault("rope_theta", self.rope_theta if self.rope_theta is not None else 1_000_000.0)
        else:
            local = self.rope_local_base_freq
            per_type.setdefault("rope_theta", local if local is not None else 10_000.0)
        if "type" in per_type and per_type["rope_type"] == "default":  # rope_scaling of transformers < 4.45
            per_type["rope_type"] = per_type["type"]
        return per_type


class Model(GemmaCausalLM):
    def __init__(self, args: ModelArgs):
        ropes = {}
        for layer_type in (SLIDING, FULL):
            params = args.rope_for(layer_type)
            ropes[layer_type] = initialize_rope(
                args.head_dim, rope_base(None, params), False, rope_scaling_config(None, params)
            )
        super().__init__(args, ropes, qk_norm=True, attn_softcap=None)
