"""Qwen3.5 text models, dense (`qwen3_5`) and MoE (`qwen3_5_moe`). Definition follows transformers' Qwen3_5TextModel
and Qwen3_5MoeTextModel.

Qwen3-Next's hybrid (qwen3_next.py: gated delta-net and gated full-attention layers, (1 + weight) norms, partial
rotary) with two differences: the delta-net projects q/k/v, z, b and a through separate layers (`in_proj_qkv`,
`in_proj_z`, `in_proj_b`, `in_proj_a`, in the convolution's channel order), and the MLPs: every layer a dense SwiGLU
(qwen3_5), or every layer the MoE block with its sigmoid-gated shared expert, top-k always renormalized (qwen3_5_moe).
The RoPE is multimodal (`mrope_section`): for text, the three position axes are one, which is the plain RoPE.

The released checkpoints are image-text (`qwen3_5`, `qwen3_5_moe`): config.json nests this config under `text_config`
(loading/hf.py flattens it and says that the vision tower is not loaded) and the weights live under
`model.language_model.` (mlx-lm: `language_model.model.`); sanitize renames them and drops `model.visual.`.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from . import qwen3_next
from .transformer import GatedMLP

_RENAMES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_TOWERS = ("model.visual.", "visual.", "vision_tower.", "model.vision_tower.")


@dataclass
class ModelArgs(qwen3_next.ModelArgs):
    """Qwen3_5TextConfig / Qwen3_5MoeTextConfig (the MoE one: num_experts > 0; the dense one has none)."""

    model_type: str = "qwen3_5_text"
    num_key_value_heads: int | None = 4
    num_experts: int = 0
    num_experts_per_tok: int = 8

    @classmethod
    def from_dict(cls, params: dict):
        """Qwen3_5MoeTextConfig has no intermediate_size (no dense MLP): 0 then."""
        return super().from_dict({"intermediate_size": 0, **params})

    def __post_init__(self):
        super().__post_init__()
        self.norm_topk_prob = True  # Qwen3.5-MoE's router always renormalizes its top k

    def is_sparse(self, layer_idx: int) -> bool:
        return self.num_experts > 0


class GatedDeltaNet(qwen3_next.GatedDeltaNet):
    """Qwen3_5GatedDeltaNet: Qwen3-Next's, its projections separate and in the convolution's channel order."""

    def init_projections(self, hidden_size: int) -> None:
        self.in_proj_qkv = nn.Linear(hidden_size, 2 * self.key_dim + self.value_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden_size, self.num_v_heads, bias=False)

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        B, L, _ = x.shape
        z = self.in_proj_z(x).reshape(B, L, self.num_v_heads, self.head_v_dim)
        return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)


class Model(qwen3_next.Model):
    @staticmethod
    def make_delta_net(args) -> nn.Module:
        return GatedDeltaNet(args)

    @staticmethod
    def make_mlp(args, layer_idx: int) -> nn.Module:
        if args.is_sparse(layer_idx):
            return qwen3_next.SharedExpertMoe(args)
        return GatedMLP(args.hidden_size, args.intermediate_size)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """An image-text checkpoint's language-model weights under the text model's names, its vision tower dropped;
        then Qwen3-Next's (mtp layers, experts, mlx-lm's layout)."""
        text = {}
        for name, value in weights.items():
            for old, new in _RENAMES:
                if name.startswith(old):
                    name = new + name[len(old) :]
                    break
            if not name.startswith(_TOWERS):
                text[name] = value
        return super().sanitize(text)
