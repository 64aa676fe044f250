"""A small HF -> GGUF converter for tests: what llama.cpp's convert_hf_to_gguf.py does to a tiny checkpoint.

Per architecture it writes the converter's metadata keys, renames tensors with the `gguf` package's own name
map (the one the converter uses), and applies the converter's changes: q/k rows interleaved (LlamaModel.permute:
llama, mistral, mixtral, granite), +1 on every `*norm.weight` (gemma2, gemma3), experts stacked [E, out, in],
Llama 3 rope scaling as a `rope_freqs` tensor. Imported by tests as `from gguf_convert import ...`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

PERMUTED = {"llama", "granite", "smollm3"}
NORM_PLUS_ONE = {"gemma2", "gemma3"}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute (rows of weights or biases)."""
    shape = w.shape
    return w.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def llama3_rope_factors(cfg: dict, head_dim: int) -> np.ndarray:
    """The converter's `rope_freqs` for a llama3 rope scaling: per-dimension period factors."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    base = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    factor, low, high = rope["factor"], rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _rope(cfg: dict, layer_type: str | None = None) -> dict:
    params = cfg.get("rope_parameters") or {}
    if layer_type is not None and layer_type in params:
        params = params[layer_type]
    return {"rope_theta": cfg.get("rope_theta", 10000.0), **params}


def _metadata(w, arch: str, cfg: dict, head_dim: int) -> None:
    import gguf

    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if "head_dim" in cfg and arch != "phi3":  # TextModel's set_gguf_parameters (Phi-3's own writes none)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch in ("llama", "granite", "phi3"):
        w.add_rope_dimension_count(int(head_dim * (cfg.get("partial_rotary_factor") or 1.0)))
    rope = _rope(cfg, "full_attention")
    w.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if arch == "olmo2":
            w.add_rope_scaling_attn_factors(rope["attention_factor"])
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if arch == "qwen3moe":
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch == "gpt-oss":
        w.add_expert_feed_forward_length(cfg["intermediate_size"])
        w.add_sliding_window(cfg["sliding_window"])
    if arch == "olmo2" and "sliding_window" in cfg:
        w.add_sliding_window(cfg["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
    if arch in ("gemma2", "gemma3"):
        w.add_sliding_window(cfg["sliding_window"])
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
    if arch == "granite":
        w.add_attention_scale(cfg["attention_multiplier"])
        w.add_embedding_scale(cfg["embedding_multiplier"])
        w.add_residual_scale(cfg["residual_multiplier"])
        w.add_logit_scale(cfg["logits_scaling"])


def _bpe_vocab(w, hf_dir: Path, pre: str) -> None:
    from tokenizers import Tokenizer

    tok_json = json.loads((hf_dir / "tokenizer.json").read_text())
    tok_cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    vocab = Tokenizer.from_file(str(hf_dir / "tokenizer.json")).get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tok_json["added_tokens"] if a["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok_json["model"]["merges"]])
    w.add_bos_token_id(vocab["<|endoftext|>"])
    w.add_eos_token_id(vocab[tok_cfg["eos_token"]])
    w.add_pad_token_id(vocab["<|endoftext|>"])
    w.add_add_bos_token(False)
    w.add_chat_template(tok_cfg["chat_template"])


class _Writer:
    """gguf.GGUFWriter whose add_tensor stores weights of 2+ dimensions in `qtype` (or its decoded values)."""

    def __init__(self, path: str, arch: str, qtype=None, dequantized: bool = False):
        import gguf

        self.writer, self.qtype, self.dequantized = gguf.GGUFWriter(path, arch), qtype, dequantized

    def __getattr__(self, name):
        return getattr(self.writer, name)

    def add_tensor(self, name: str, arr: np.ndarray) -> None:
        import gguf

        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if self.qtype is None or arr.ndim < 2 or not name.endswith(".weight"):  # llama-quantize: 2+-D weights only
            self.writer.add_tensor(name, arr)
            return
        if arr.shape[-1] % gguf.GGML_QUANT_SIZES[self.qtype][0]:  # rows shorter than a block: llama-quantize falls back
            self.writer.add_tensor(name, arr)
            return
        packed = gguf.quants.quantize(arr, self.qtype)
        if self.dequantized:
            self.writer.add_tensor(name, gguf.quants.dequantize(packed, self.qtype).reshape(arr.shape))
        else:
            self.writer.add_tensor(name, packed, raw_dtype=self.qtype)


def _experts(state: dict, layer: int, prefix: str, n: int, arch: str) -> dict[str, np.ndarray]:
    """Stacked [E, out, in] gate/up/down (and gpt-oss's biases) for one layer from per-expert or transformers'
    fused tensors."""
    base = f"model.layers.{layer}.{prefix}.experts"
    if arch == "gpt-oss":  # [E, in, 2 x out], gate in the even outputs, up in the odd ones (GptOssModel)
        gate_up = state.pop(f"{base}.gate_up_proj").swapaxes(1, 2)
        bias = state.pop(f"{base}.gate_up_proj_bias")
        return {
            "gate": gate_up[:, 0::2],
            "up": gate_up[:, 1::2],
            "down": state.pop(f"{base}.down_proj").swapaxes(1, 2),
            "gate.bias": bias[:, 0::2],
            "up.bias": bias[:, 1::2],
            "down.bias": state.pop(f"{base}.down_proj_bias"),
        }
    if f"{base}.gate_up_proj" in state:
        gate, up = np.split(state.pop(f"{base}.gate_up_proj"), 2, axis=1)
        return {"gate": gate, "up": up, "down": state.pop(f"{base}.down_proj")}
    names = {"gate": ("w1", "gate_proj"), "up": ("w3", "up_proj"), "down": ("w2", "down_proj")}
    out = {}
    for kind, options in names.items():
        name = next(o for o in options if f"{base}.0.{o}.weight" in state)
        out[kind] = np.stack([state.pop(f"{base}.{e}.{name}.weight") for e in range(n)])
    return out


def convert(
    hf_dir: Path,
    out_path: Path,
    arch: str,
    name: str = "tiny",
    pre: str = "default",
    file_arch: str | None = None,
    qtype=None,
    dequantized: bool = False,
) -> Path:
    """Write `hf_dir` (a tiny transformers checkpoint with the tiny BPE tokenizer) as a GGUF of `arch`: F32, or
    with every weight of 2+ dimensions in `qtype` (a gguf.GGMLQuantizationType), or (`dequantized`) in F32 holding
    exactly the values that `qtype` file decodes to. `file_arch`: another `general.architecture` to write."""
    import gguf
    from gguf_convert_hybrid import ARCHS as HYBRID_ARCHS
    from gguf_convert_hybrid import convert_hybrid
    from safetensors.numpy import load_file

    if arch in HYBRID_ARCHS:
        return convert_hybrid(hf_dir, out_path, arch, name, pre, file_arch, qtype, dequantized)
    from gguf_convert_mla import MLA_ARCHS, convert_mla

    if arch in MLA_ARCHS:
        return convert_mla(hf_dir, out_path, arch, name, pre, file_arch, qtype, dequantized)
    import gguf_convert_gemma4

    if arch in gguf_convert_gemma4.ARCHS:
        return gguf_convert_gemma4.convert(hf_dir, out_path, arch, name, pre, file_arch, qtype, dequantized)

    cfg = json.loads((hf_dir / "config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    n_layers = cfg["num_hidden_layers"]
    w = _Writer(str(out_path), file_arch or arch, qtype=qtype, dequantized=dequantized)
    w.add_name(name)
    _metadata(w, arch, cfg, head_dim)
    _bpe_vocab(w, hf_dir, pre)
    file_types = {"Q8_0": 7, "Q4_0": 2, "Q4_1": 3}  # llama.cpp's LlamaFileType
    w.add_file_type(0 if qtype is None or dequantized else file_types[qtype.name])

    state = {k: v.astype(np.float32) for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), n_layers)
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if experts:
        prefix = "block_sparse_moe" if any(".block_sparse_moe." in k for k in state) else "mlp"
        for layer in range(n_layers):
            for kind, arr in _experts(state, layer, prefix, experts, arch).items():
                kind, _, suffix = kind.partition(".")
                w.add_tensor(f"blk.{layer}.ffn_{kind}_exps.{suffix or 'weight'}", np.ascontiguousarray(arr))
    rope = _rope(cfg)
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg, head_dim))
    if rope.get("rope_type") == "longrope":  # Phi3MiniModel: factors as tensors, the context lengths as metadata
        original = cfg.get("original_max_position_embeddings") or rope["original_max_position_embeddings"]
        scale = cfg["max_position_embeddings"] / original
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    for hf_name, arr in state.items():
        stem, suffix = hf_name.rsplit(".", 1) if hf_name.endswith((".weight", ".bias")) else (hf_name, "weight")
        if arch in PERMUTED and stem.endswith("q_proj"):
            arr = permute(arr, heads)
        elif arch in PERMUTED and stem.endswith("k_proj"):
            arr = permute(arr, kv_heads)
        if arch in NORM_PLUS_ONE and hf_name.endswith("norm.weight"):
            arr = arr + 1
        gguf_name = names.get_name(stem)
        assert gguf_name is not None, hf_name
        w.add_tensor(f"{gguf_name}.{suffix}", arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path
