"""Qwen2 / Qwen2.5 family. Definition follows transformers' Qwen2Model.

Differences from Llama: q/k/v projections carry a bias (o_proj does not), and layers listed as
"sliding_attention" in `layer_types` (by default those from `max_window_layers` on, when
`use_sliding_window` is set) attend to the last `sliding_window` keys only.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UnsupportedModelError
from .rope import RoPE, initialize_rope
from .transformer import Attention, DecoderLayer, GatedMLP, TransformerArgs, TransformerLM


def layer_windows(
    num_layers: int,
    use_sliding_window: bool,
    sliding_window: int | None,
    max_window_layers: int,
    layer_types: list[str] | None,
) -> list[int | None]:
    """Each layer's attention window (None = full), as Qwen2Config/Qwen3Config derive it."""
    window = sliding_window if use_sliding_window else None
    if layer_types is None:
        layer_types = [
            "sliding_attention" if window is not None and i >= max_window_layers else "full_attention"
            for i in range(num_layers)
        ]
    if len(layer_types) != num_layers:
        raise UnsupportedModelError(f"layer_types lists {len(layer_types)} layers, the model has {num_layers}")
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise UnsupportedModelError(f"layer type(s) {', '.join(unknown)} are not supported")
    return [window if kind == "sliding_attention" else None for kind in layer_types]


@dataclass
class ModelArgs(TransformerArgs):
    """Qwen3 extends this (explicit head_dim, attention_bias)."""

    model_type: str = "qwen2"
    max_position_embeddings: int = 32768
    use_sliding_window: bool = False
    max_window_layers: int = 28
    layer_types: list[str] | None = None

    def __post_init__(self):
        super().__post_init__()
        self.windows = layer_windows(
            self.num_hidden_layers,
            self.use_sliding_window,
            self.sliding_window,
            self.max_window_layers,
            self.layer_types,
        )


def make_rope(args) -> RoPE:
    """Shared with Qwen3 / Qwen3-MoE: the scaling (e.g. YaRN) may fall back on max_position_embeddings."""
    return initialize_rope(
        args.head_dim, args.rope_base, False, args.rope_scaling, max_position_embeddings=args.max_position_embeddings
    )


class Model(TransformerLM):
    def __init__(self, args: ModelArgs):
        layers = [
            DecoderLayer(
                args,
                Attention(args, make_rope(args), bias=True, o_bias=False, window=window),
                GatedMLP(args.hidden_size, args.intermediate_size),
            )
            for window in args.windows
        ]
        super().__init__(args, layers)
