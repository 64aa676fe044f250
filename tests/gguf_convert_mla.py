"""The test converter's deepseek2 and glm4moe: what llama.cpp's convert_hf_to_gguf.py (DeepseekV2Model,
Glm4MoeModel, and TextModel's shared metadata) writes for a tiny DeepseekV3 / Glm4Moe checkpoint.

deepseek2: MLA declared as MQA over the latent (head_count_kv 1, key/value length of the latent, the per-head sizes
as key_length_mla / value_length_mla), kv_b_proj split per head into attn_k_b (W_UK transposed) and attn_v_b,
mscale_all_dim written as yarn_log_multiplier = 0.1 * mscale_all_dim, MTP layers skipped. `legacy`: the converter
before the split (early 2025): attn_kv_b whole, per-head key_length / value_length, head_count_kv = heads.
glm4moe: block_count counts the MTP layers, which are kept (their nextn.* tensors too), with nextn_predict_layers.
Both: experts stacked [E, out, in], `e_score_correction_bias` as `exp_probs_b.bias`, the router kept in float.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

MLA_ARCHS = {"deepseek2", "glm4moe"}


def _rope_parameters(cfg: dict) -> dict:
    return {"rope_theta": cfg.get("rope_theta", 10000.0), **(cfg.get("rope_parameters") or {})}


def _moe_metadata(w, cfg: dict) -> None:
    import gguf

    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_group_count(cfg["n_group"])
    w.add_expert_group_used_count(cfg["topk_group"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)  # the released configs' scoring_func "sigmoid"
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)


def _metadata(w, arch: str, cfg: dict, block_count: int, legacy: bool) -> None:
    import gguf

    rope = _rope_parameters(cfg)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(block_count)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for key, add in (
            ("beta_fast", w.add_rope_scaling_yarn_beta_fast),
            ("beta_slow", w.add_rope_scaling_yarn_beta_slow),
        ):
            if key in rope:
                add(rope[key])
    _moe_metadata(w, cfg)
    if arch == "glm4moe":
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        factor = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5))
        w.add_head_count_kv(cfg["num_key_value_heads"])
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_rope_dimension_count(int(head_dim * factor))
        w.add_nextn_predict_layers(cfg.get("num_nextn_predict_layers", 0))
        return
    rank, rope_dim = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    w.add_vocab_size(cfg["vocab_size"])
    if cfg.get("q_lora_rank") is not None:
        w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(rank)
    w.add_rope_dimension_count(rope_dim)
    if legacy:
        w.add_head_count_kv(cfg["num_key_value_heads"])
        w.add_key_length(cfg["qk_nope_head_dim"] + rope_dim)
        w.add_value_length(cfg["v_head_dim"])
    else:
        w.add_head_count_kv(1)
        w.add_key_length(rank + rope_dim)
        w.add_value_length(rank)
        w.add_key_length_mla(cfg["qk_nope_head_dim"] + rope_dim)
        w.add_value_length_mla(cfg["v_head_dim"])
    if rope.get("mscale_all_dim") is not None:
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _tensors(state: dict, cfg: dict, arch: str, legacy: bool):
    """(HF stem, suffix, array) in the converter's form: experts stacked, kv_b split, the MTP layers of deepseek2
    skipped, lm_head skipped where tied."""
    n_layers, experts = cfg["num_hidden_layers"], cfg["n_routed_experts"]
    for hf_name in list(state):
        if hf_name not in state:  # an expert stacked with expert 0
            continue
        match = re.match(r"model\.layers\.(\d+)\.", hf_name)
        layer = int(match.group(1)) if match else None
        arr = state.pop(hf_name)
        if (arch == "deepseek2" and layer is not None and layer >= n_layers) or (
            hf_name == "lm_head.weight" and cfg.get("tie_word_embeddings")
        ):
            continue
        if m := re.match(r"(model\.layers\.\d+\.mlp\.experts)\.0\.(\w+)\.weight$", hf_name):
            base, kind = m.groups()
            stacked = [arr] + [state.pop(f"{base}.{e}.{kind}.weight") for e in range(1, experts)]
            yield f"{base}.{kind}", "weight", np.stack(stacked)
        elif hf_name.endswith("e_score_correction_bias"):
            yield hf_name.removesuffix("_bias"), "bias", arr
        elif hf_name.endswith("kv_b_proj.weight") and not legacy:
            heads, nope, v = cfg["num_key_value_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
            kv_b = arr.reshape(heads, nope + v, arr.shape[-1])
            stem = hf_name.removesuffix(".kv_b_proj.weight")
            yield f"{stem}.k_b_proj", "weight", kv_b[:, :nope].swapaxes(1, 2)
            yield f"{stem}.v_b_proj", "weight", kv_b[:, nope:]
        elif not re.search(r"experts\.\d+\.", hf_name):
            stem, suffix = hf_name.rsplit(".", 1)
            yield stem, suffix, arr


def convert_mla(
    hf_dir: Path,
    out_path: Path,
    arch: str,
    name: str = "tiny",
    pre: str = "default",
    file_arch: str | None = None,
    qtype=None,
    dequantized: bool = False,
    legacy: bool = False,
) -> Path:
    """gguf_convert.convert's contract for deepseek2 / glm4moe; `legacy`: deepseek2 as converted before the kv_b
    split."""
    import gguf
    from gguf_convert import _bpe_vocab, _Writer
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    nextn = cfg.get("num_nextn_predict_layers", 0) if arch == "glm4moe" else 0
    block_count = cfg["num_hidden_layers"] + nextn
    w = _Writer(str(out_path), file_arch or arch, qtype=qtype, dequantized=dequantized)
    w.add_name(name)
    _metadata(w, arch, cfg, block_count, legacy)
    _bpe_vocab(w, hf_dir, pre)
    w.add_file_type(0 if qtype is None or dequantized else {"Q8_0": 7, "Q4_0": 2, "Q4_1": 3}[qtype.name])

    state = {k: v.astype(np.float32) for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), block_count)
    for stem, suffix, arr in _tensors(state, cfg, arch, legacy):
        gguf_name = names.get_name(stem)
        assert gguf_name is not None, stem
        full = f"{gguf_name}.{suffix}"
        if gguf_name.endswith("ffn_gate_inp"):  # the converter and llama-quantize keep the router in F32
            w.writer.add_tensor(full, np.ascontiguousarray(arr, dtype=np.float32))
        else:
            w.add_tensor(full, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path
