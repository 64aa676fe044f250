"""SmolLM3. Definition follows transformers' modeling_smollm3.py (SmolLM3ForCausalLM).

Llama layers (q/k/v/o biases from `attention_bias`, SwiGLU MLP biases from `mlp_bias`, RMSNorm, tied embeddings
by default) with NoPE layers: where `no_rope_layers[i]` is 0, layer i rotates neither queries nor keys (the causal
mask alone orders its positions). Without the list, every `no_rope_layer_interval`-th layer (the 4th, 8th, ... by
default) is a NoPE layer. The RoPE of the others is the checkpoint's (default theta 2e6; scaling such as YaRN from
`rope_scaling` / `rope_parameters`).

Sliding-window layers are those `layer_types` lists as "sliding_attention"; without `layer_types`, the NoPE layers
when `use_sliding_window` is set and `sliding_window` is not null (as SmolLM3Config derives them). A sliding layer
attends to the last `sliding_window` keys, as transformers' eager and SDPA masks do (they read `layer_types` and
`sliding_window`, not `use_sliding_window`).

Released checkpoints (transformers 4.5x) write `rope_theta` + `rope_scaling`, the `no_rope_layers` list and an
unused `max_window_layers`; transformers 5 writes `rope_parameters`. Both load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx
import mlx.nn as nn

from ..errors import UnsupportedModelError
from .qwen2 import layer_windows, make_rope
from .transformer import Attention, DecoderLayer, GatedMLP, TransformerArgs, TransformerLM

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass
class ModelArgs(TransformerArgs):
    """Defaults are SmolLM3Config's (4 KV heads, tied embeddings, 32k positions)."""

    model_type: str = "smollm3"
    num_key_value_heads: int | None = 4
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    mlp_bias: bool = False
    no_rope_layers: list[int] | None = None
    no_rope_layer_interval: int = 4
    use_sliding_window: bool = False
    layer_types: list[str] | None = None

    default_rope_theta: ClassVar[float] = 2_000_000.0

    def __post_init__(self):
        super().__post_init__()
        self.uses_rope = self.rope_layers()
        self.windows = self.layer_windows()

    def rope_layers(self) -> list[bool]:
        """Whether each layer applies RoPE (`no_rope_layers`, else every `no_rope_layer_interval`-th layer skips it)."""
        n = self.num_hidden_layers
        flags = self.no_rope_layers
        if flags is None:
            flags = [int((i + 1) % self.no_rope_layer_interval != 0) for i in range(n)]
        if len(flags) < n:
            raise UnsupportedModelError(f"no_rope_layers lists {len(flags)} layers, the model has {n}")
        return [bool(flag) for flag in flags[:n]]

    def layer_windows(self) -> list[int | None]:
        """Each layer's attention window (None = full), from `layer_types` or as SmolLM3Config derives them."""
        layer_types = self.layer_types
        if layer_types is None:
            slides = self.use_sliding_window and self.sliding_window is not None
            layer_types = [SLIDING if slides and not rope else FULL for rope in self.uses_rope]
        if SLIDING in layer_types and self.sliding_window is None:
            raise UnsupportedModelError("layer_types lists sliding_attention layers but sliding_window is not set")
        # use_sliding_window=True: the window goes to every layer layer_types calls sliding (max_window_layers unused)
        return layer_windows(self.num_hidden_layers, True, self.sliding_window, 0, list(layer_types))


class NoPE(nn.Module):
    """The position embedding of a NoPE layer: none. Takes RoPE's call and returns queries / keys unrotated (not a
    RoPE instance, so backend kernels that fold a RoPE into their projections leave this layer alone)."""

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        return x


class Model(TransformerLM):
    """Stock decoder layers; a NoPE layer's attention gets `NoPE` as its rope."""

    def __init__(self, args: ModelArgs):
        layers = [
            DecoderLayer(
                args,
                Attention(args, make_rope(args) if rope else NoPE(), bias=args.attention_bias, window=window),
                GatedMLP(args.hidden_size, args.intermediate_size, bias=args.mlp_bias),
            )
            for rope, window in zip(args.uses_rope, args.windows)
        ]
        super().__init__(args, layers)
