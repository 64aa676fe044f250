"""GGUF architectures `gemma4` (our gemma4_text), `llama4` (llama4_text) and `mistral3` (ministral3): their config
from the metadata and the tensor changes llama.cpp's converter (conversion/gemma.py, llama4.py, mistral3.py) makes.

gemma4 (Gemma4Model): norms stored as they are (Gemma 4's norms scale by `weight`: no +1); the head size of the full
layers is `attention.key_length`, of the sliding ones `key_length_swa`; per-layer KV heads and feed-forward widths
(double-wide MLPs of the KV-shared layers) are arrays; `attention.shared_kv_layers` counts the KV-shared layers; a
full layer without `attn_v` takes its values from the keys (attention_k_eq_v). The full layers' proportional RoPE is
a `rope_freqs` tensor: 1 for the rotated frequencies, 1e30 (frequency 0) for the others. The router's `scale` is
`ffn_gate_inp.scale`, its `per_expert_scale` `ffn_down_exps.scale`; the experts' gate and up projections stay fused
(`ffn_gate_up_exps`, gate first); `layer_scalar` is `layer_output_scale`. llama.cpp fixes the attention scale at 1.

llama4 (Llama4Model): q/k rows not permuted (its RoPE rotates interleaved pairs, as llama.cpp's); experts' gate and
up split, down transposed to [E, out, in]; dense layers' width is `feed_forward_length`, the experts' and shared
expert's `expert_feed_forward_length`. llama.cpp fixes the chunk size (8192), the NoPE period (4), the temperature
tuning (floor 8192, scale 0.1) and turns the q/k norm off for the 128-expert model: the file stores none of them.

mistral3 (Ministral3Model, a LlamaModel): q/k rows permuted as llama's; YaRN with the query scaling's beta as
`attention.temperature_scale` (its length is the YaRN original context); llama.cpp's mistral3 graph cancels YaRN's
attention factor (1.0).
"""

from __future__ import annotations

from typing import Any

from ..errors import CorruptModelError, UnsupportedModelError
from . import gguf_hparams

SLIDING, FULL, CHUNKED = "sliding_attention", "full_attention", "chunked_attention"
_UNROTATED = 1e29  # llama.cpp's converter writes 1e30: a frequency of (effectively) 0


# -- gemma4 -----------------------------------------------------------------------------------------------------------


def _per_layer(m, key: str, n: int) -> list[int] | None:
    value = m.meta.get(f"{m.arch}.{key}")
    if value is None:
        return None
    values = gguf_hparams.as_list(value) if hasattr(value, "tolist") or isinstance(value, list) else None
    if values is None or len(values) == 1:
        return [int(gguf_hparams.as_scalar(value) if values is None else values[0])] * n
    if len(values) != n:
        raise CorruptModelError(f"GGUF {m.arch}.{key} has {len(values)} values for {n} layers")
    return [int(v) for v in values]


def gemma4_base_meta(m):
    """The metadata for the generic config: the per-layer arrays gemma4_extra reads itself reduced to layer 0's."""
    meta = dict(m.meta)
    n = int(m.need("block_count"))
    for key in ("attention.head_count_kv", "feed_forward_length"):
        values = _per_layer(m, key, n)
        if values is not None:
            meta[f"{m.arch}.{key}"] = values[0]
    # the full layers' head size; the rope dims (checked here) may differ from it only on the sliding layers
    meta.pop(f"{m.arch}.rope.dimension_count", None)
    return gguf_hparams.Meta(meta, m.arch, m.names)


def gemma4_extra(config: dict, m) -> None:
    n = config["num_hidden_layers"]
    config.pop("head_dim", None)
    full_dim, swa_dim = int(m.need("attention.key_length")), int(m.need("attention.key_length_swa"))
    for key, expected in (("attention.value_length", full_dim), ("attention.value_length_swa", swa_dim)):
        if m.get(key) is not None and int(m.get(key)) != expected:
            raise UnsupportedModelError(f"GGUF gemma4 with value length {m.get(key)} != key length {expected}")
    for key, dims in (("rope.dimension_count", full_dim), ("rope.dimension_count_swa", swa_dim)):
        if m.get(key) is not None and int(m.get(key)) != dims:
            raise UnsupportedModelError(
                f"GGUF gemma4 with partial rotary embedding ({m.get(key)} of {dims} dims, {key}) is not supported"
            )
    pattern = m.meta.get("gemma4.attention.sliding_window_pattern")
    if pattern is None:
        raise CorruptModelError("GGUF metadata has no 'gemma4.attention.sliding_window_pattern'")
    gguf_hparams.sliding_layer_types(config, m, None)
    types = config["layer_types"]
    shared = int(m.get("attention.shared_kv_layers", 0))
    first_shared = n - shared
    kv_heads = _per_layer(m, "attention.head_count_kv", n) or [config["num_attention_heads"]] * n
    config.update(
        head_dim=swa_dim,
        global_head_dim=full_dim,
        num_key_value_heads=_one_per_type(kv_heads, types, SLIDING, "KV head count", config["num_key_value_heads"]),
        per_layer_config={
            i: {"head_dim": full_dim, "num_key_value_heads": kv_heads[i]} for i, t in enumerate(types) if t == FULL
        },
        sliding_window=int(m.need("attention.sliding_window")),
        num_kv_shared_layers=shared,
        final_logit_softcapping=m.get("final_logit_softcapping") or None,
        attention_k_eq_v=_k_eq_v(m, types, first_shared),
        hidden_size_per_layer_input=int(m.need("embedding_length_per_layer_input")),
        vocab_size_per_layer_input=config["vocab_size"],
    )
    widths = _per_layer(m, "feed_forward_length", n) or [int(m.need("feed_forward_length"))] * n
    config["intermediate_size"] = widths[0]
    config["use_double_wide_mlp"] = shared > 0 and widths[first_shared] == 2 * widths[0]
    expected = [widths[0] * (2 if config["use_double_wide_mlp"] and i >= first_shared else 1) for i in range(n)]
    if widths != expected:
        raise UnsupportedModelError(f"GGUF gemma4 with per-layer feed-forward lengths {widths} is not supported")
    _gemma4_rope(config, m)
    _gemma4_moe(config, m)


def _one_per_type(values: list[int], types: list[str], kind: str, what: str, default: int) -> int:
    chosen = {v for v, t in zip(values, types) if t == kind}
    if len(chosen) > 1:
        raise UnsupportedModelError(
            f"GGUF gemma4 {kind} layers of different {what}s ({sorted(chosen)}) are not supported"
        )
    return chosen.pop() if chosen else default


def _k_eq_v(m, types: list[str], first_shared: int) -> bool:
    """Full layers without `attn_v` take their values from the keys (llama.cpp's use_alternative_attention); our
    model does so for every full layer or none, and never on sliding layers."""
    missing = [i for i in range(first_shared) if f"blk.{i}.attn_v.weight" not in m.names]
    if any(types[i] == SLIDING for i in missing):
        raise UnsupportedModelError(
            "GGUF gemma4 sliding layers without attn_v (values from the keys) are not supported"
        )
    full = [i for i in range(first_shared) if types[i] == FULL]
    if missing and missing != full:
        raise UnsupportedModelError("GGUF gemma4 with attn_v on some full layers and not others is not supported")
    return bool(missing)


def _gemma4_rope(config: dict, m) -> None:
    scaling = config.get("rope_scaling")  # rope_freqs: gguf_names turns the tensor into factors for gemma4_fixup
    if scaling is not None and scaling.get("rope_type") != "rope_freqs":
        raise UnsupportedModelError(f"GGUF gemma4 with rope scaling '{scaling.get('rope_type')}' is not supported")
    theta = config.pop("rope_theta")
    full = {"rope_type": "default", "rope_theta": theta}
    if scaling is not None:  # the factors come from the tensor (gemma4_fixup)
        full = {"rope_type": "proportional", "partial_rotary_factor": None, "rope_theta": theta}
    swa_theta = m.get("rope.freq_base_swa")
    config["rope_parameters"] = {
        SLIDING: {"rope_type": "default", "rope_theta": float(theta if swa_theta is None else swa_theta)},
        FULL: full,
    }


def _gemma4_moe(config: dict, m) -> None:
    experts = int(m.get("expert_count", 0) or 0)
    config["enable_moe_block"] = bool(experts)
    if not experts:
        return
    routed = [f"blk.{i}.ffn_gate_inp.weight" in m.names for i in range(config["num_hidden_layers"])]
    if not all(routed):
        raise UnsupportedModelError("GGUF gemma4 with experts on some layers only is not supported")
    config.update(
        num_experts=experts,
        top_k_experts=int(m.need("expert_used_count")),
        moe_intermediate_size=int(m.need("expert_feed_forward_length")),
    )


def _proportional_factor(config: dict) -> float:
    """The rotated fraction of the full layers' head from the `rope_freqs` factors (1: rotated, 1e30: not)."""
    factors = config.pop("rope_scaling")["short_factor"]
    rotated = next((i for i, f in enumerate(factors) if f != 1.0), len(factors))
    if len(factors) * 2 != config["global_head_dim"] or any(f < _UNROTATED for f in factors[rotated:]):
        raise UnsupportedModelError(
            "GGUF gemma4 rope_freqs other than proportional RoPE's (1 for the rotated frequencies, 1e30 for the "
            "others, one per pair of the full layers' head) are not supported"
        )
    return 2 * rotated / config["global_head_dim"]


def gemma4_fixup(out: dict[str, Any], config: dict) -> None:
    """Fused expert gate/up split, layer scalars bare, the proportional RoPE's fraction from the rope factors."""
    import mlx.core as mx  # here: the config side of this module stays MLX-free

    full = config["rope_parameters"][FULL]
    if full["rope_type"] == "proportional":
        full["partial_rotary_factor"] = _proportional_factor(config)
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}"
        if f"{layer}.layer_scalar.weight" in out:
            out[f"{layer}.layer_scalar"] = out.pop(f"{layer}.layer_scalar.weight")
        else:  # llama.cpp: no layer_output_scale is a scale of 1
            out[f"{layer}.layer_scalar"] = mx.ones((1,))
        if not config["enable_moe_block"]:
            continue
        if f"{layer}.router.scale" not in out:
            raise CorruptModelError(f"GGUF gemma4 file has no blk.{i}.ffn_gate_inp.scale (the router's scale)")
        # llama.cpp: no ffn_down_exps.scale is a scale of 1
        out.setdefault(f"{layer}.router.per_expert_scale", mx.ones((config["num_experts"],)))
        for suffix in ("weight", "scales", "biases"):
            fused = out.pop(f"{layer}.experts.gate_up.{suffix}", None)
            if fused is None:
                continue
            half = fused.shape[1] // 2
            out[f"{layer}.experts.switch_glu.gate_proj.{suffix}"] = mx.contiguous(fused[:, :half])
            out[f"{layer}.experts.switch_glu.up_proj.{suffix}"] = mx.contiguous(fused[:, half:])


# -- llama4 -----------------------------------------------------------------------------------------------------------


def llama4_extra(config: dict, m) -> None:
    window = m.get("attention.sliding_window")
    if window is not None and int(window) == 0:
        raise UnsupportedModelError("GGUF llama4 without chunked attention (sliding_window 0) is not supported")
    base_swa = m.get("rope.freq_base_swa")
    if base_swa is not None and float(base_swa) != config["rope_theta"]:
        raise UnsupportedModelError("GGUF llama4 with a chunked layers' RoPE base of its own is not supported")
    experts = int(m.need("expert_count"))
    n = config["num_hidden_layers"]
    period = int(gguf_hparams.as_scalar(m.meta.get("llama4.attention.sliding_window_pattern", 4)))
    config.update(
        intermediate_size_mlp=config["intermediate_size"],
        intermediate_size=int(m.need("expert_feed_forward_length")),
        num_local_experts=experts,
        num_experts_per_tok=int(m.need("expert_used_count")),
        interleave_moe_layer_step=int(m.need("interleave_moe_layer_step")),
        use_qk_norm=experts != 128,  # llama.cpp: no q/k norm for the 17B-128E model (Maverick)
        attention_bias="blk.0.attn_q.bias" in m.names,
        attention_chunk_size=8192,
        no_rope_layer_interval=4,
        attn_temperature_tuning=True,
        floor_scale=8192,
        attn_scale=0.1,
        layer_types=[CHUNKED if (i + 1) % period else FULL for i in range(n)],
    )


# -- mistral3 ---------------------------------------------------------------------------------------------------------


def ministral3_extra(config: dict, m) -> None:
    if m.get("expert_count", 0):
        raise UnsupportedModelError("GGUF mistral3 with experts is not supported (our ministral3 is dense)")
    beta = float(m.get("attention.temperature_scale", 0.0))
    scaling = config.pop("rope_scaling", None)
    if scaling is None:  # llama.cpp: the query scaling's length is then the training context
        rope = {"rope_type": "default", "original_max_position_embeddings": config["max_position_embeddings"]}
    elif scaling["rope_type"] == "yarn":
        rope = {"beta_fast": 32.0, "beta_slow": 1.0, **scaling, "attention_factor": 1.0}
        rope.setdefault("original_max_position_embeddings", config["max_position_embeddings"])
    else:
        raise UnsupportedModelError(f"GGUF mistral3 with rope scaling '{scaling['rope_type']}' is not supported")
    config["rope_parameters"] = {**rope, "rope_theta": config["rope_theta"], "llama_4_scaling_beta": beta}


# -- tensor names -----------------------------------------------------------------------------------------------------

_ATTN = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
}
LAYER_NAMES: dict[str, dict[str, str]] = {
    "gemma4_text": {
        **_ATTN,
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        "layer_output_scale": "layer_scalar",
        "inp_gate": "per_layer_input_gate",
        "proj": "per_layer_projection",
        "post_norm": "post_per_layer_input_norm",
        "ffn_gate_inp": "router.proj",
        "ffn_gate_inp.scale": "router.scale",
        "ffn_down_exps.scale": "router.per_expert_scale",
        "ffn_gate_up_exps": "experts.gate_up",
        "ffn_gate_exps": "experts.switch_glu.gate_proj",
        "ffn_up_exps": "experts.switch_glu.up_proj",
        "ffn_down_exps": "experts.switch_glu.down_proj",
        "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
        "post_ffw_norm_1": "post_feedforward_layernorm_1",
        "post_ffw_norm_2": "post_feedforward_layernorm_2",
    },
    "llama4_text": {
        **_ATTN,
        "ffn_norm": "post_attention_layernorm",
        "ffn_gate": "feed_forward.gate_proj",
        "ffn_up": "feed_forward.up_proj",
        "ffn_down": "feed_forward.down_proj",
        "ffn_gate_inp": "feed_forward.router",
        "ffn_gate_exps": "feed_forward.experts.gate_proj",
        "ffn_up_exps": "feed_forward.experts.up_proj",
        "ffn_down_exps": "feed_forward.experts.down_proj",
        "ffn_gate_shexp": "feed_forward.shared_expert.gate_proj",
        "ffn_up_shexp": "feed_forward.shared_expert.up_proj",
        "ffn_down_shexp": "feed_forward.shared_expert.down_proj",
    },
    "ministral3": {
        **_ATTN,
        "ffn_norm": "post_attention_layernorm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    },
}
# Top-level tensors beyond token_embd / output_norm / output, by our model type.
TOP_NAMES: dict[str, dict[str, str]] = {
    "gemma4_text": {
        "per_layer_token_embd": "model.embed_tokens_per_layer",
        "per_layer_model_proj": "model.per_layer_model_projection",
        "per_layer_proj_norm": "model.per_layer_projection_norm",
    },
}
FIXUPS = {"gemma4_text": gemma4_fixup}
