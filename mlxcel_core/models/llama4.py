"""Llama 4 text (Scout, Maverick). Definition follows transformers' modeling_llama4.py / configuration_llama4.py
(Llama4ForCausalLM / Llama4TextModel, and the language model of Llama4ForConditionalGeneration).

Differences from Llama (llama.py):
- RoPE rotates interleaved pairs (transformers multiplies complex numbers made of x[2i], x[2i + 1]: MLX's
  `traditional` RoPE), with llama3 scaling in the released checkpoints; the default base is 500000.
- NoPE layers: layer i rotates nothing where `no_rope_layers[i]` is 0 (by default every `no_rope_layer_interval`-th
  layer). The RoPE layers attend in chunks (`attention_chunk_size`: a query sees the keys of its own chunk of
  positions, causally; transformers' "chunked_attention" layer type), the NoPE layers attend to everything before
  them ("full_attention"). `layer_types`, when config.json has it, decides which layer attends how.
- On the RoPE layers, `use_qk_norm` RMS-normalizes queries and keys per head after the rotation, without a weight
  (Llama4TextL2Norm, eps = rms_norm_eps).
- On the NoPE layers, `attn_temperature_tuning` scales the queries of position p by
  1 + attn_scale * log(1 + floor((p + 1) / floor_scale)) (float32, then the queries' dtype). p is each row's
  absolute position, so a batch's rows (an array offset) are scaled per row.
- The feed-forward block of the layers in `moe_layers` (by default every `interleave_moe_layer_step`-th) is a MoE
  (Llama4MoE: sigmoid top-k router whose score scales the expert's input, plus a shared SwiGLU expert, both of
  `intermediate_size`); the other layers have a dense SwiGLU of `intermediate_size_mlp`.

Checkpoints store each MoE layer's experts fused (`experts.gate_up_proj` [E, hidden, 2 * inter], gate first, and
`experts.down_proj` [E, inter, hidden]); sanitize splits and transposes them into SwitchGLU's [E, out, in] banks
under `experts.{gate,up,down}_proj` (mlx-lm's names, so its quantized Llama 4 checkpoints load too).

The released checkpoints are image-text (`llama4`): config.json nests this config under `text_config` (loading/hf.py
flattens it and says that the vision tower is not loaded), and the weights live under `language_model.model.` (or
`model.language_model.`); sanitize renames them and drops the vision model and projector.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..errors import UnsupportedModelError
from .base import LayerCache, attention, cache_offset, normed
from .gemma_common import text_tower_weights
from .moe import SwitchGLU
from .rope import RoPE, initialize_rope
from .transformer import (
    Attention,
    DecoderLayer,
    GatedMLP,
    TransformerArgs,
    TransformerLM,
    add_projection,
    heads_first,
    heads_last,
)

CHUNKED, FULL = "chunked_attention", "full_attention"


@dataclass
class ModelArgs(TransformerArgs):
    """Defaults are Llama4TextConfig's (Scout, 17B-16E)."""

    hidden_size: int = 5120
    num_hidden_layers: int = 48
    intermediate_size: int = 8192
    num_attention_heads: int = 40
    vocab_size: int = 202048
    model_type: str = "llama4_text"
    rms_norm_eps: float = 1e-5
    num_key_value_heads: int | None = 8
    head_dim: int | None = 128
    max_position_embeddings: int = 4096 * 32
    intermediate_size_mlp: int = 16384
    attention_bias: bool = False
    num_experts_per_tok: int = 1
    num_local_experts: int = 16
    moe_layers: list[int] | None = None
    interleave_moe_layer_step: int = 1
    use_qk_norm: bool = True
    no_rope_layers: list[int] | None = None
    no_rope_layer_interval: int = 4
    attention_chunk_size: int | None = 8192
    layer_types: list[str] | None = None
    attn_temperature_tuning: bool | int = True  # released configs write 4: any true value turns it on
    floor_scale: float = 8192
    attn_scale: float = 0.1

    default_rope_theta = 500000.0

    def __post_init__(self):
        super().__post_init__()
        n = self.num_hidden_layers
        interval = self.no_rope_layer_interval
        rope_flags = self.no_rope_layers or [int((i + 1) % interval != 0) for i in range(n)]
        if len(rope_flags) < n:
            raise UnsupportedModelError(f"llama4 no_rope_layers has {len(rope_flags)} entries for {n} layers")
        self.no_rope_layers = [int(flag) for flag in rope_flags]
        step = self.interleave_moe_layer_step
        self.moe_layers = list(range(step - 1, n, step)) if self.moe_layers is None else list(self.moe_layers)
        if self.layer_types is None:
            chunked = self.attention_chunk_size is not None
            self.layer_types = [CHUNKED if flag and chunked else FULL for flag in self.no_rope_layers[:n]]
        self.layer_types = list(self.layer_types)[:n]
        unknown = sorted(set(self.layer_types) - {CHUNKED, FULL})
        if unknown or len(self.layer_types) != n:
            raise UnsupportedModelError(f"llama4 layer_types {unknown or self.layer_types} are not supported")
        if CHUNKED in self.layer_types and self.attention_chunk_size is None:
            raise UnsupportedModelError("llama4 chunked_attention layers need attention_chunk_size")

    def uses_rope(self, layer_idx: int) -> bool:
        return bool(self.no_rope_layers[layer_idx])


def l2_norm(x: mx.array, eps: float) -> mx.array:
    """x / sqrt(mean(x^2) + eps) over the last axis, no weight (transformers' Llama4TextL2Norm)."""
    return mx.fast.rms_norm(x, None, eps)


def attention_temperature(offset: int | mx.array, length: int, floor_scale: float, attn_scale: float) -> mx.array:
    """1 + attn_scale * log(1 + floor((p + 1) / floor_scale)) for the positions p of `length` queries from `offset`
    (an int, or one per batch row), float32 [rows or 1, 1, length, 1]. A left-padded row's pad columns have negative
    positions: they count as 0 (their queries are discarded)."""
    start = offset[..., None] if isinstance(offset, mx.array) else offset
    positions = mx.maximum(mx.arange(length) + start, 0).astype(mx.float32)
    scale = mx.log1p(mx.floor((positions + 1.0) / floor_scale)) * attn_scale + 1.0
    return scale.reshape(-1, 1, length, 1)


class Llama4Attention(Attention):
    """Llama4TextAttention: RoPE (or none, a NoPE layer), then the weightless q/k norm on RoPE layers or the query
    temperature on NoPE layers; chunked attention (`chunk`) where the layer type says so."""

    def __init__(self, args: ModelArgs, layer_idx: int, rope: RoPE):
        uses_rope = args.uses_rope(layer_idx)
        super().__init__(args, rope if uses_rope else None, bias=args.attention_bias)
        self.uses_rope = uses_rope
        self.l2_qk_norm = bool(args.use_qk_norm) and uses_rope
        self.eps = args.rms_norm_eps
        self.chunk = args.attention_chunk_size if args.layer_types[layer_idx] == CHUNKED else None
        tuned = bool(args.attn_temperature_tuning) and not uses_rope
        self.temperature = (float(args.floor_scale), float(args.attn_scale)) if tuned else None

    def project_rotated(
        self, x: mx.array, norm: nn.Module | None, offset: int | mx.array
    ) -> tuple[mx.array, mx.array, mx.array]:
        q, k, v = self.project(x, norm)
        q, k, v = (heads_first(t, n) for t, n in ((q, self.n_heads), (k, self.n_kv_heads), (v, self.n_kv_heads)))
        if self.uses_rope:
            q, k = self.rope(q, offset), self.rope(k, offset)
        if self.l2_qk_norm:
            q, k = l2_norm(q, self.eps), l2_norm(k, self.eps)
        if self.temperature is not None:
            q = (q * attention_temperature(offset, q.shape[2], *self.temperature)).astype(q.dtype)
        return q, k, v

    def __call__(
        self,
        x: mx.array,
        cache: LayerCache | None,
        residual: mx.array | None = None,
        norm: nn.Module | None = None,
        last_only: bool = False,
    ) -> mx.array:
        """Attention.__call__ with the layer's chunk (None on full-attention layers)."""
        q, k, v = self.project_rotated(x, norm, cache_offset(cache))
        if last_only:
            q = q[:, :, -1:, :]
            residual = None if residual is None else residual[:, -1:, :]
        out = attention(q, k, v, cache, self.scale, chunk=self.chunk)
        return add_projection(self.o_proj, heads_last(out), residual)


class Llama4MoE(nn.Module):
    """Llama4TextMoe: the router's top-k logits through a sigmoid scale each selected expert's INPUT (not its output);
    the experts' outputs are summed (in expert order, as transformers sums over all experts, the others' being zero)
    and added to the shared expert's."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.router = nn.Linear(args.hidden_size, args.num_local_experts, bias=False)
        self.experts = SwitchGLU(args.hidden_size, args.intermediate_size, args.num_local_experts)
        self.shared_expert = GatedMLP(args.hidden_size, args.intermediate_size)

    def __call__(self, x: mx.array, residual: mx.array | None = None, norm: nn.Module | None = None) -> mx.array:
        x = normed(x, norm)
        logits = self.router(x)
        k = self.top_k
        indices = mx.stop_gradient(mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k])
        if k > 1:
            indices = mx.sort(indices, axis=-1)
        scores = mx.sigmoid(mx.take_along_axis(logits, indices, axis=-1).astype(mx.float32)).astype(x.dtype)
        routed = None
        for j in range(k):
            out = self.experts(x * scores[..., j : j + 1], indices[..., j : j + 1])[..., 0, :]
            routed = out if routed is None else routed + out
        y = self.shared_expert(x) + routed
        return y if residual is None else residual + y


class Model(TransformerLM):
    def __init__(self, args: ModelArgs):
        rope = initialize_rope(
            args.head_dim, args.rope_base, True, args.rope_scaling, max_position_embeddings=args.max_position_embeddings
        )
        layers = []
        for i in range(args.num_hidden_layers):
            if i in args.moe_layers:
                mlp = Llama4MoE(args)
            else:
                mlp = GatedMLP(args.hidden_size, args.intermediate_size_mlp)
            layers.append(DecoderLayer(args, Llama4Attention(args, i, rope), mlp, mlp_name="feed_forward"))
        super().__init__(args, layers)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Image-text checkpoints: the language model's weights renamed, the vision model's and projector's dropped;
        the fused expert banks split into SwitchGLU's. FP8 checkpoints (`weight_scale` tensors) are refused."""
        if any(name.endswith(("weight_scale", "weight_scale_inv")) for name in weights):
            raise UnsupportedModelError(
                "FP8-quantized llama4 checkpoints (weight_scale tensors) are not supported: "
                "use the BF16 release or an MLX-quantized copy"
            )
        weights = text_tower_weights(weights)
        for i in self.args.moe_layers:
            prefix = f"model.layers.{i}.feed_forward.experts"
            gate_up = weights.pop(f"{prefix}.gate_up_proj", None)
            if gate_up is None:  # already split (mlx-lm, or our own quantized output)
                continue
            inter = gate_up.shape[-1] // 2
            # Own contiguous copies, not strided views (see moe.stack_experts): one copy, at load.
            weights[f"{prefix}.gate_proj.weight"] = mx.contiguous(gate_up[..., :inter].swapaxes(1, 2))
            weights[f"{prefix}.up_proj.weight"] = mx.contiguous(gate_up[..., inter:].swapaxes(1, 2))
            weights[f"{prefix}.down_proj.weight"] = mx.contiguous(weights.pop(f"{prefix}.down_proj").swapaxes(1, 2))
        return super().sanitize(weights)
