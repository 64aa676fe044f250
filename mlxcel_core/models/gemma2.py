"""Gemma 2. Definition follows transformers' modeling_gemma2.py (Gemma2ForCausalLM).

On top of the shared Gemma layers (gemma_common): every other layer uses sliding-window attention
(layer 0 first, unless config.json lists `layer_types`), attention logits are soft-capped with
`attn_logit_softcapping` and the final logits with `final_logit_softcapping`; one RoPE for all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

from .gemma_common import FULL, SLIDING, GemmaArgs, GemmaCausalLM
from .rope import initialize_rope, rope_base, rope_scaling_config


@dataclass
class ModelArgs(GemmaArgs):
    model_type: str = "gemma2"

    def default_layer_types(self) -> list[str]:
        return [SLIDING if (i + 1) % 2 else FULL for i in range(self.num_hidden_layers)]


class Model(GemmaCausalLM):
    def __init__(self, args: ModelArgs):
        scaling = rope_scaling_config(args.rope_scaling, args.rope_parameters)
        rope = initialize_rope(args.head_dim, rope_base(args.rope_theta, args.rope_parameters), False, scaling)
        super().__init__(args, {SLIDING: rope, FULL: rope}, qk_norm=False, attn_softcap=args.attn_logit_softcapping)
