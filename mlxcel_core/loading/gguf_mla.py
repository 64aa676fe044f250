"""GGUF `deepseek2` (DeepSeek-V3 / V3.x, Kimi-K2, Moonlight: our deepseek_v3) and `glm4moe` (GLM-4.5 / 4.6: our
glm4_moe): their config from the metadata, their tensor names, and the fix-ups after the name mapping.

What llama.cpp's converter (convert_hf_to_gguf.py: DeepseekV2Model, Glm4MoeModel) writes, and how it is undone:
- deepseek2 declares MLA as multi-query attention over the latent: `head_count_kv` 1, `attention.key_length`
  kv_lora_rank + rope, `attention.value_length` kv_lora_rank; the per-head sizes are `attention.key_length_mla`
  (nope + rope) and `attention.value_length_mla`. Current converters split kv_b_proj per head into `attn_k_b`
  [H, kv_lora_rank, nope] (W_UK, transposed) and `attn_v_b` [H, v, kv_lora_rank] (W_UV): exactly our `embed_q` /
  `unembed_out` layout, mapped as they are. Older files carry the unsplit `attn_kv_b` and the per-head sizes in
  key_length / value_length; the model's sanitize splits it (decoded to float first where quantized, so the split
  stays exact).
- llama.cpp rotates interleaved pairs for deepseek2 (rope_interleave true) and reads YaRN's mscale_all_dim as
  `rope.scaling.yarn_log_multiplier` / 0.1 with mscale taken equal to it (llama-context.cpp), so YaRN's rotation
  factor is 1 and the softmax scale takes mscale ** 2. The file's RMS epsilon is the model's rms_norm_eps; the
  latent norms keep DeepSeek's fixed 1e-6, as the checkpoint and transformers compute them (llama.cpp applies the
  file's epsilon there too: Moonlight's 1e-5).
- Routing: `expert_gating_func` (sigmoid only; llama.cpp's default for a deepseek2 file without it is softmax,
  DeepSeek-V2's), the selection bias `exp_probs_b.bias` (our e_score_correction_bias), `expert_weights_scale`
  (routed_scaling_factor; absent: 1), `expert_weights_norm` (norm_topk_prob; absent: false), `expert_group_count` /
  `expert_group_used_count` (n_group / topk_group), `expert_shared_count`, `leading_dense_block_count`.
- glm4moe keeps the multi-token-prediction layer: `block_count` counts it and `nextn_predict_layers` says how many
  there are; llama.cpp skips them in the forward pass, so they are dropped here. Partial rotary comes from
  `rope.dimension_count` (half-split, as our glm4_moe); q/k norms and q/k/v biases from the tensors present.
"""

from __future__ import annotations

from typing import Any

from ..errors import CorruptModelError, UnsupportedModelError

SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID (1: softmax)

_GROUPED_MOE = {
    "ffn_gate": "mlp.gate_proj",  # the dense leading layers
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "exp_probs_b": "mlp.gate.e_score_correction",  # `.bias`: renamed by _fix_router
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
# The multi-token-prediction layers' own tensors (glm4moe keeps them): named under their layer, which the model's
# sanitize drops with the rest of the layers past num_hidden_layers.
_NEXTN = {
    f"nextn.{part}": f"nextn.{part}"
    for part in ("eh_proj", "enorm", "hnorm", "embed_tokens", "shared_head_head", "shared_head_norm")
}
# GGUF block tensor parts -> our parameter names, by model_type (gguf_names.LAYER_NAMES).
LAYER_NAMES: dict[str, dict[str, str]] = {
    "deepseek_v3": {
        "attn_norm": "input_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_q_a": "self_attn.q_a_proj",
        "attn_q_a_norm": "self_attn.q_a_layernorm",
        "attn_q_b": "self_attn.q_b_proj",
        "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
        "attn_kv_a_norm": "self_attn.kv_a_layernorm",
        "attn_kv_b": "self_attn.kv_b_proj",
        "attn_k_b": "self_attn.embed_q",
        "attn_v_b": "self_attn.unembed_out",
        "attn_output": "self_attn.o_proj",
        "ffn_norm": "post_attention_layernorm",
        **_GROUPED_MOE,
        **_NEXTN,
    },
    "glm4_moe": {
        "attn_norm": "input_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "post_attention_norm": "post_attention_layernorm",
        **_GROUPED_MOE,
        **_NEXTN,
    },
}


def _nextn_layers(config: dict, m) -> None:
    """`block_count` minus the `nextn_predict_layers` multi-token-prediction layers llama.cpp does not run."""
    nextn = int(m.get("nextn_predict_layers", 0) or 0)
    if nextn >= config["num_hidden_layers"]:
        raise CorruptModelError(f"GGUF {m.arch}.nextn_predict_layers {nextn} leaves no decoder layer")
    config["num_hidden_layers"] -= nextn
    config["num_nextn_predict_layers"] = nextn


def _grouped_moe(config: dict, m, default_gating: int) -> None:
    """The GroupedMoeBlock's routing from the `<arch>.expert_*` keys (llama.cpp's defaults where absent)."""
    dense = int(m.get("leading_dense_block_count", 0) or 0)
    config["first_k_dense_replace"] = dense
    if dense >= config["num_hidden_layers"]:
        return  # every layer dense: no routing
    gating = int(m.get("expert_gating_func", 0) or default_gating)
    if gating != SIGMOID:
        name = {1: "softmax"}.get(gating, f"type {gating}")
        raise UnsupportedModelError(f"GGUF {m.arch} with {name} expert gating is not supported (supported: sigmoid)")
    n_group = int(m.get("expert_group_count", 0) or 1)
    config.update(
        n_routed_experts=int(m.need("expert_count")),
        num_experts_per_tok=int(m.need("expert_used_count")),
        moe_intermediate_size=int(m.need("expert_feed_forward_length")),
        n_shared_experts=int(m.get("expert_shared_count", 0) or 0),
        routed_scaling_factor=float(m.get("expert_weights_scale", 0.0) or 1.0),  # 0 / absent: no scaling
        norm_topk_prob=bool(m.get("expert_weights_norm", False)),
        n_group=n_group,
        topk_group=int(m.need("expert_group_used_count")) if n_group > 1 else 1,
    )


def _yarn_mscale(config: dict, m) -> None:
    """deepseek2's YaRN as llama.cpp computes it: mscale = mscale_all_dim = yarn_log_multiplier / 0.1 (1 when
    absent), no separate attention factor."""
    scaling = config.get("rope_scaling")
    if not scaling or scaling.get("rope_type") != "yarn":
        return
    log_mul = float(m.get("rope.scaling.yarn_log_multiplier", 0.0) or 0.0)
    mscale = log_mul / 0.1 if log_mul else 1.0
    scaling.pop("attention_factor", None)
    scaling.update(mscale=mscale, mscale_all_dim=mscale)


def deepseek2_config(config: dict, m) -> None:
    """`config` (gguf_arch's base, without its head geometry) completed for our deepseek_v3."""
    _nextn_layers(config, m)
    rope = int(m.need("rope.dimension_count"))
    if m.has("attention.key_length_mla"):  # the split (MLA) form
        key, value = int(m.need("attention.key_length_mla")), int(m.need("attention.value_length_mla"))
    else:  # older files: the per-head sizes as key/value length, kv_b unsplit
        key, value = int(m.need("attention.key_length")), int(m.need("attention.value_length"))
    if key <= rope:
        raise CorruptModelError(f"GGUF {m.arch} key length {key} leaves no non-rotary part beside rope {rope}")
    q_lora = m.get("attention.q_lora_rank")
    config.update(
        num_key_value_heads=config["num_attention_heads"],  # the file's 1 is the latent's single key head
        kv_lora_rank=int(m.need("attention.kv_lora_rank")),
        q_lora_rank=int(q_lora) if q_lora else None,
        qk_rope_head_dim=rope,
        qk_nope_head_dim=key - rope,
        v_head_dim=value,
        rope_interleave=True,  # llama.cpp's rope type for deepseek2: interleaved pairs
        attention_bias="blk.0.attn_kv_a_mqa.bias" in m.names,
    )
    _grouped_moe(config, m, default_gating=1)
    _yarn_mscale(config, m)


def glm4moe_config(config: dict, m) -> None:
    """`config` (gguf_arch's base, without its head geometry) completed for our glm4_moe."""
    _nextn_layers(config, m)
    sections = m.array("rope.dimension_sections")
    if sections and any(sections):
        raise UnsupportedModelError(f"GGUF {m.arch} with multimodal RoPE sections {sections} is not supported")
    head_dim = config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    factor = config.setdefault("partial_rotary_factor", 1.0)  # the base sets it where rope dims < head_dim
    rope = int(m.get("rope.dimension_count", head_dim))
    if int(head_dim * factor) != rope:
        raise UnsupportedModelError(f"GGUF {m.arch} with {rope} rotary dims of {head_dim} is not supported")
    config.update(
        use_qk_norm="blk.0.attn_q_norm.weight" in m.names,
        attention_bias="blk.0.attn_q.bias" in m.names,
    )
    _grouped_moe(config, m, default_gating=SIGMOID)  # llama.cpp's glm4moe default


def _fix_router(out: dict[str, Any], config: dict) -> None:
    """`exp_probs_b.bias` -> `gate.e_score_correction_bias`; the router stays float (llama.cpp's converter and
    llama-quantize never quantize ffn_gate_inp; our router is not a Linear)."""
    for name in [n for n in out if n.endswith(".mlp.gate.e_score_correction.bias")]:
        out[name.replace(".e_score_correction.bias", ".e_score_correction_bias")] = out.pop(name)
    quantized = [n for n in out if n.endswith(".mlp.gate.scales")]
    if quantized:
        raise UnsupportedModelError(f"GGUF {config['model_type']} router {quantized[0][:-7]} is quantized")
    for i in range(config.get("first_k_dense_replace", 0), config["num_hidden_layers"]):
        if f"model.layers.{i}.mlp.gate.e_score_correction_bias" not in out:
            raise UnsupportedModelError(
                f"GGUF {config['model_type']} layer {i} has no exp_probs_b (the expert selection bias): routing "
                "without it is not supported"
            )


def _dequantized_kv_b(out: dict[str, Any], prefix: str, in_dims: int) -> None:
    """An older file's quantized attn_kv_b as float (its exact decoded values), for sanitize's per-head split."""
    import mlx.core as mx  # here: the config side of this module stays MLX-free

    scales = out.pop(f"{prefix}.scales", None)
    if scales is None:
        return
    biases = out.pop(f"{prefix}.biases", None)
    if biases is None:
        raise UnsupportedModelError(f"GGUF {prefix} in a quantization without biases is not supported")
    weight = out[f"{prefix}.weight"]
    bits = weight.shape[-1] * 32 // in_dims
    out[f"{prefix}.weight"] = mx.dequantize(
        weight, scales, biases, group_size=in_dims // scales.shape[-1], bits=bits, dtype=mx.float32
    )


def deepseek_v3_fixup(out: dict[str, Any], config: dict) -> None:
    _fix_router(out, config)
    for i in range(config["num_hidden_layers"]):
        attn = f"model.layers.{i}.self_attn"
        if f"{attn}.embed_q.weight" in out:  # split form: a kv_b kept beside it is the same weights
            for suffix in ("weight", "scales", "biases"):
                out.pop(f"{attn}.kv_b_proj.{suffix}", None)
        elif f"{attn}.kv_b_proj.weight" in out:
            _dequantized_kv_b(out, f"{attn}.kv_b_proj", config["kv_lora_rank"])


def glm4_moe_fixup(out: dict[str, Any], config: dict) -> None:
    _fix_router(out, config)


FIXUPS = {"deepseek_v3": deepseek_v3_fixup, "glm4_moe": glm4_moe_fixup}
