"""Scaled-down copies of the random-weight shapes (mlxcel_core/loading/shapes.py) for smoke tests and twin checks.

    config, summary = scaled_down(shape_config("glm-4.5-air"))   # same keys, hidden 256, 4 layers, 8 experts

A copy keeps every key of its shape's config.json-style dict and so builds the same architecture class (the same
attention kinds, MoE routing, MLA latent, per-layer embeddings, KV sharing, mxfp4 experts): only sizes shrink. Every
matrix's input dimension stays a multiple of 64, so --bits quantizes the same modules as at full size, and spans at
least two 64-groups: MLX 0.32.4's CUDA quantized_matmul computes wrong (or has no kernel) where a layer's input is
one group (backends/cuda/kernels/mlx_workarounds.py), and mlx-lm's twin layers get no such route around. Sliding
windows and attention chunks shrink to 4 positions, so a 12-token check already crosses them.
"""

from __future__ import annotations

from typing import Any

# Sizes a scaled-down copy takes, for the keys its shape has.
SMALL_SIZES: dict[str, int] = {
    "hidden_size": 256,
    "num_attention_heads": 4,
    "head_dim": 64,
    "global_head_dim": 128,
    "intermediate_size": 512,
    "intermediate_size_mlp": 512,
    "block_ff_dim": 512,
    "moe_intermediate_size": 128,
    "vocab_size": 512,
    "vocab_size_per_layer_input": 512,
    "hidden_size_per_layer_input": 128,
    "n_routed_experts": 8,
    "num_local_experts": 4,
    "kv_lora_rank": 128,
    "qk_rope_head_dim": 32,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "sliding_window": 4,
    "attention_chunk_size": 4,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
}
SMALL_LAYERS = 4
SMALL_TOP_K = 2  # experts a token at most (a top-1 shape keeps 1)


def scaled_down(config: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """(a copy of `config` at test size, one line naming what changed)."""
    small = dict(config)
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    for key, value in SMALL_SIZES.items():
        if key in small and small[key] is not None:
            small[key] = value
    if "mrope_section" in (config.get("rope_parameters") or {}):  # its sections add up to the rotating half-head
        small["head_dim"] = config["head_dim"]
    if "num_key_value_heads" in small:  # the same grouping: MHA stays MHA, GQA keeps as few KV heads as it can
        small["num_key_value_heads"] = max(1, SMALL_SIZES["num_attention_heads"] * kv_heads // heads)
    if small.get("q_lora_rank"):
        small["q_lora_rank"] = 128
    if "num_experts_per_tok" in small:
        small["num_experts_per_tok"] = min(small["num_experts_per_tok"], SMALL_TOP_K)
    small["num_hidden_layers"] = SMALL_LAYERS
    if config.get("full_attn_idxs"):  # LFM2's attention layers among its convolutions: those still in range
        small["full_attn_idxs"] = [i for i in config["full_attn_idxs"] if i < SMALL_LAYERS] or [SMALL_LAYERS - 1]
    if "layer_types" in config:
        small.update(_short_layer_pattern(config))
    changed = ", ".join(f"{k} {_short(small[k])}" for k in small if small[k] != config.get(k))
    return small, f"scaled down ({changed})"


def _short_layer_pattern(config: dict[str, Any]) -> dict[str, Any]:
    """Two periods of (2 sliding, 1 full) for a layer_types list (Gemma's 5:1); with KV sharing, the second period
    reads the first one's KV, as a full shape's last layers read its last stored sliding and full layer."""
    types = list(config["layer_types"])
    kinds = list(dict.fromkeys(types))
    pattern = [kinds[0]] * 2 + kinds[1:]
    layers = pattern * 2
    out: dict[str, Any] = {"layer_types": layers, "num_hidden_layers": len(layers)}
    if config.get("num_kv_shared_layers"):
        out["num_kv_shared_layers"] = len(pattern)
    return out


def _short(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ",".join(str(v).replace("_attention", "") for v in value) + "]"
    return str(value)
