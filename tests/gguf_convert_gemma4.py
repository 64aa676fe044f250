"""llama.cpp's converter for gemma4, llama4 and mistral3 (conversion/gemma.py Gemma4Model, llama4.py Llama4Model,
mistral3.py Ministral3Model, over TextModel / Gemma3Model / LlamaModel), as tests/gguf_convert.py does for the other
architectures: the metadata each writes, tensor names from the `gguf` package's map, and the tensor changes.

- gemma4: no +1 on the norms; full layers' head size as key_length, sliding ones' as key_length_swa; per-layer KV
  heads (when the full layers have their own) and feed-forward widths (double-wide MLPs) as arrays; the proportional
  RoPE as a `rope_freqs` tensor (1 rotated, 1e30 not); router.scale -> ffn_gate_inp.scale, per_expert_scale ->
  ffn_down_exps.scale, fused experts kept fused (ffn_gate_up_exps), layer_scalar -> layer_output_scale.
- llama4: no q/k permute; fused experts split into gate and up and transposed, down transposed; llama3 rope factors
  with the converter's original context (the top-level `original_max_position_embeddings`, else 8192).
- mistral3: q/k permuted as llama; YaRN metadata plus yarn_log_multiplier and attention.temperature_scale.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from gguf_convert import _bpe_vocab, _Writer, permute

ARCHS = ("gemma4", "llama4", "mistral3")
S, F = "sliding_attention", "full_attention"


def _common(w, cfg: dict) -> None:
    """TextModel.set_gguf_parameters' shared keys."""
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])


def _gemma4_geometry(cfg: dict) -> tuple[int, int | None]:
    """(full layers' head size, their KV heads where they differ): released configs write global_head_dim and
    num_global_key_value_heads, transformers 5 the per_layer_config that the converter's hparams resolve to."""
    full = [o for i, o in (cfg.get("per_layer_config") or {}).items() if cfg["layer_types"][int(i)] == F]
    head = cfg.get("global_head_dim") or (full[0]["head_dim"] if full else cfg["head_dim"])
    kv = cfg.get("num_global_key_value_heads") or (full[0].get("num_key_value_heads") if full else None)
    return head, kv


def _gemma4_metadata(w, cfg: dict) -> None:
    import gguf

    _common(w, cfg)
    n, types = cfg["num_hidden_layers"], cfg["layer_types"]
    full_dim, full_kv = _gemma4_geometry(cfg)
    swa = [t == S for t in types]
    w.add_head_count_kv(
        [cfg["num_key_value_heads"] if s else full_kv for s in swa] if full_kv else cfg["num_key_value_heads"]
    )
    shared = cfg["num_kv_shared_layers"]
    ff = cfg["intermediate_size"]
    w.add_feed_forward_length(
        [ff if i < n - shared else 2 * ff for i in range(n)] if cfg.get("use_double_wide_mlp") else ff
    )
    rope = cfg["rope_parameters"]
    w.add_rope_freq_base(rope[F]["rope_theta"])
    w.add_rope_freq_base_swa(rope[S]["rope_theta"])
    if cfg.get("num_experts"):
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["top_k_experts"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_shared_kv_layers(shared)
    w.add_embedding_length_per_layer_input(cfg.get("hidden_size_per_layer_input") or 0)
    w.add_sliding_window_pattern(swa)
    w.add_key_length(full_dim)
    w.add_value_length(full_dim)
    w.add_key_length_swa(cfg["head_dim"])
    w.add_value_length_swa(cfg["head_dim"])
    w.add_rope_dimension_count(full_dim)
    w.add_rope_dimension_count_swa(cfg["head_dim"])
    assert rope[F]["rope_type"] == "proportional"
    rotated = int(full_dim * rope[F]["partial_rotary_factor"] / 2)
    factors = [1.0] * rotated + [1e30] * (full_dim // 2 - rotated)
    w.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", np.array(factors, dtype=np.float32))


def _gemma4_tensor(hf_name: str, arr: np.ndarray, cfg: dict, hf_dir: Path):
    """(HF stem, suffix, array) as Gemma4Model.filter_tensors / modify_tensors leave it; stem None: a GGUF name."""
    if hf_name.endswith("embed_tokens.weight"):  # Gemma3Model drops the out-of-vocabulary rows
        tok = json.loads((hf_dir / "tokenizer.json").read_text())
        arr = arr[: len(tok["model"]["vocab"]) + len(tok["added_tokens"])]
    layer = hf_name.split(".")[2] if hf_name.startswith("model.layers.") else None
    if hf_name.endswith("router.scale"):
        return None, f"blk.{layer}.ffn_gate_inp.scale", arr
    if hf_name.endswith("router.per_expert_scale"):
        return None, f"blk.{layer}.ffn_down_exps.scale", arr
    if hf_name.endswith(("layer_scalar", "experts.gate_up_proj", "experts.down_proj")):
        return hf_name, "weight", arr
    stem, suffix = hf_name.rsplit(".", 1)
    return stem, suffix, arr


def _llama4_metadata(w, cfg: dict, head_dim: int) -> None:
    import gguf

    _common(w, cfg)
    w.add_feed_forward_length(cfg["intermediate_size_mlp"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    rope = cfg["rope_parameters"]
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_rope_dimension_count(head_dim)
    w.add_interleave_moe_layer_step(cfg["interleave_moe_layer_step"])
    w.add_expert_feed_forward_length(cfg["intermediate_size"])
    if rope.get("rope_type") == "llama3":  # LlamaModel.generate_extra_tensors
        old = cfg.get("original_max_position_embeddings", 8192)
        factors = _llama3_factors(rope, head_dim, old)
        w.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", factors)


def _llama3_factors(rope: dict, dim: int, old: int) -> np.ndarray:
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    out = []
    for freq in 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _llama4_tensors(hf_name: str, arr: np.ndarray):
    """Llama4Model.modify_tensors: fused experts split (gate first) and transposed to [E, out, in]."""
    if hf_name.endswith("experts.gate_up_proj"):
        inter = arr.shape[-1] // 2
        base = hf_name[: -len("gate_up_proj")]
        yield base + "gate_proj", "weight", arr[..., :inter].swapaxes(1, 2)
        yield base + "up_proj", "weight", arr[..., inter:].swapaxes(1, 2)
    elif hf_name.endswith("experts.down_proj"):
        yield hf_name, "weight", arr.swapaxes(1, 2)
    else:
        yield (*hf_name.rsplit(".", 1), arr)


def _mistral3_metadata(w, cfg: dict, head_dim: int) -> None:
    import gguf

    _common(w, cfg)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    rope = cfg["rope_parameters"]
    assert rope["rope_type"] == "yarn", "ministral3 rope_type must be 'yarn'"
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_rope_dimension_count(head_dim)
    w.add_rope_scaling_yarn_log_mul(rope["mscale_all_dim"])
    w.add_attn_temperature_scale(rope["llama_4_scaling_beta"])


def _tensors(arch: str, cfg: dict, state: dict, hf_dir: Path, heads: tuple[int, int]):
    """(HF stem or None, suffix or GGUF name, array) for every tensor the converter writes."""
    for hf_name, arr in state.items():
        if arch == "gemma4":
            yield _gemma4_tensor(hf_name, arr, cfg, hf_dir)
        elif arch == "llama4":
            yield from _llama4_tensors(hf_name, arr)
        else:
            stem, suffix = hf_name.rsplit(".", 1)
            if stem.endswith("q_proj"):
                arr = permute(arr, heads[0])
            elif stem.endswith("k_proj"):
                arr = permute(arr, heads[1])
            yield stem, suffix, arr


def convert(hf_dir: Path, out_path: Path, arch: str, name: str, pre: str, file_arch, qtype, dequantized) -> Path:
    """gguf_convert.convert for these architectures (same arguments)."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    heads = (cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads[0]
    w = _Writer(str(out_path), file_arch or arch, qtype=qtype, dequantized=dequantized)
    w.add_name(name)
    if arch == "gemma4":
        _gemma4_metadata(w, cfg)
    elif arch == "llama4":
        _llama4_metadata(w, cfg, head_dim)
    else:
        _mistral3_metadata(w, cfg, head_dim)
    _bpe_vocab(w, hf_dir, pre)
    w.add_file_type(0 if qtype is None or dequantized else {"Q8_0": 7, "Q4_0": 2, "Q4_1": 3}[qtype.name])
    state = {k: v.astype(np.float32) for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), 64)
    for stem, suffix, arr in _tensors(arch, cfg, state, hf_dir, heads):
        if stem is None:
            w.add_tensor(suffix, np.ascontiguousarray(arr))
            continue
        gguf_name = names.get_name(stem)
        assert gguf_name is not None, stem
        w.add_tensor(f"{gguf_name}.{suffix}", np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path
