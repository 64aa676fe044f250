"""The test converter (gguf_convert.py) for the hybrid recurrent families: what llama.cpp's convert_hf_to_gguf.py
does for `qwen3next` (Qwen3NextModel), `qwen35` / `qwen35moe` (Qwen3_5TextModel / Qwen3_5MoeTextModel over
_LinearAttentionVReorderBase) and `lfm2` (LFM2Model): their metadata keys and tensor changes.

- gated delta-net: A_log -> -exp(A_log) (`ssm_a`, bare), dt_bias -> `ssm_dt.bias`, conv1d [C, 1, K] squeezed to
  [C, K], +1 on every `*norm.weight` but the delta-net's gated norm; Qwen3-Next's in_proj_qkvz split into `attn_qkv`
  (all q, all k, all v) and `attn_gate` (z); Qwen3.5's value heads reordered from grouped to tiled when there are
  fewer key than value heads; experts stacked [E, out, in];
- LFM2: the KV head count per layer (0 for a convolution layer), the adjusted feed-forward width, the short
  convolution [C, 1, K] squeezed to [C, K];
- Nemotron-H (dense, `nemotron_h`): Mamba2's A as -exp(A_log) [H, 1], D [H, 1], the gated norm [groups, size],
  dt_bias renamed, the convolution squeezed; the attention's q/k rows interleaved; per-layer KV heads and widths.
Like llama-quantize, a quantized file keeps the convolution weights in F32.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf_convert import _bpe_vocab, _Writer, permute

ARCHS = {"qwen3next", "qwen35", "qwen35moe", "lfm2", "nemotron_h"}
DELTA_NET = {"qwen3next", "qwen35", "qwen35moe"}
_FILE_TYPES = {"Q8_0": 7, "Q4_0": 2, "Q4_1": 3}  # llama.cpp's LlamaFileType


class _HybridWriter(_Writer):
    """llama-quantize leaves the convolution kernels (`ssm_conv1d`, `shortconv.conv`) and norms in float."""

    def add_tensor(self, name: str, arr: np.ndarray) -> None:
        if "ssm_conv1d" in name or "shortconv.conv" in name or "_norm.weight" in name:
            self.writer.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
            return
        super().add_tensor(name, arr)


def _interval(cfg: dict) -> int:
    """full_attention_interval as Qwen3NextModel writes it (the checkpoint's, else the one its layer_types follow)."""
    if "full_attention_interval" in cfg:
        return cfg["full_attention_interval"]
    full = [i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention"]
    every = full[0] + 1
    assert full == list(range(every - 1, cfg["num_hidden_layers"], every)), cfg["layer_types"]
    return every


def _lfm2_ff(cfg: dict) -> int:
    """LFM2Model._add_feed_forward_length."""
    ff = cfg.get("block_ff_dim") or cfg["intermediate_size"]
    if cfg["block_auto_adjust_ff_dim"]:
        ff = int(2 * ff / 3)
        if cfg["block_ffn_dim_multiplier"] is not None:
            ff = int(cfg["block_ffn_dim_multiplier"] * ff)
            multiple = cfg["block_multiple_of"]
            ff = multiple * ((ff + multiple - 1) // multiple)
    return ff


def _nemotron_h_metadata(w, cfg: dict) -> None:
    """NemotronHModel (dense) over GraniteHybridModel: per-layer KV heads and feed-forward widths (0 where a block
    has none), the Mamba2 sizes, an arbitrary context (no RoPE)."""
    kinds = cfg["layers_block_type"]
    w.add_context_length(2**20)
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(len(kinds))
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv([cfg["num_key_value_heads"] if k == "full_attention" else 0 for k in kinds])
    w.add_feed_forward_length([cfg["intermediate_size"] if k == "mlp" else 0 for k in kinds])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["layer_norm_epsilon"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_ssm_conv_kernel(cfg["conv_kernel"])
    w.add_ssm_state_size(cfg["ssm_state_size"])
    w.add_ssm_group_count(cfg["n_groups"])
    w.add_ssm_inner_size(cfg["mamba_num_heads"] * cfg["mamba_head_dim"])
    w.add_ssm_time_step_rank(cfg["mamba_num_heads"])


def _nemotron_h_tensor(stem: str, suffix, arr: np.ndarray, cfg: dict):
    """Mamba2Model.modify_tensors for the Mamba2 blocks, LlamaModel's q/k permute for the attention blocks."""
    if stem.endswith(".dt_bias"):
        return stem.removesuffix(".dt_bias") + ".dt_proj", "bias", arr
    if stem.endswith("mixer.conv1d"):
        return stem, suffix, arr.squeeze()
    if stem.endswith(".A_log"):
        return stem, suffix, -np.exp(arr.reshape(-1, 1))
    if stem.endswith(".D"):
        return stem, suffix, arr.reshape(-1, 1)
    if stem.endswith("mixer.norm"):
        return stem, suffix, arr.reshape(cfg["n_groups"], -1)
    if stem.endswith("q_proj"):
        return stem, suffix, permute(arr, cfg["num_attention_heads"])
    if stem.endswith("k_proj"):
        return stem, suffix, permute(arr, cfg["num_key_value_heads"])
    return stem, suffix, arr


def _metadata(w, arch: str, cfg: dict) -> None:
    """TextModel.set_gguf_parameters and each family's additions."""
    if arch == "nemotron_h":
        return _nemotron_h_metadata(w, cfg)
    rope = cfg.get("rope_parameters") or {}
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg.get("block_count", cfg["num_hidden_layers"]))
    w.add_head_count(cfg["num_attention_heads"])
    w.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if arch == "lfm2":
        w.add_head_count_kv([cfg["num_key_value_heads"] if t != "conv" else 0 for t in cfg["layer_types"]])
        w.add_feed_forward_length(_lfm2_ff(cfg))
        w.add_vocab_size(cfg["vocab_size"])
        w.add_shortconv_l_cache(cfg["conv_L_cache"])
        w.add_layer_norm_rms_eps(cfg["norm_eps"])
        return
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if cfg.get("intermediate_size"):
        w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    if cfg.get("num_experts"):
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    w.add_ssm_state_size(cfg["linear_key_head_dim"])
    w.add_ssm_group_count(cfg["linear_num_key_heads"])
    w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
    w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    w.add_full_attention_interval(_interval(cfg))
    factor = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    w.add_rope_dimension_count(int(cfg["head_dim"] * factor))
    if arch != "qwen3next":
        w.add_rope_dimension_sections([*rope.get("mrope_section", [11, 11, 10]), 0][:4])


def _tiled(arr: np.ndarray, axis: int, nk: int, per: int, head_dim: int) -> np.ndarray:
    """_LinearAttentionVReorderBase._reorder_v_heads: value heads grouped by key head -> tiled, along `axis`."""
    moved = np.moveaxis(arr, axis, 0)
    tiled = moved.reshape(nk, per, head_dim, *moved.shape[1:]).swapaxes(0, 1).reshape(moved.shape)
    return np.moveaxis(tiled, 0, axis)


def _reorder_values(stem: str, arr: np.ndarray, cfg: dict) -> np.ndarray:
    """Qwen3.5's value-head reorder (only with fewer key than value heads)."""
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, per = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], nv // nk
    if nk == nv or ".linear_attn." not in stem + ".":
        return arr
    qk = 2 * nk * dk
    if stem.endswith("in_proj_qkv"):
        return np.concatenate([arr[:qk], _tiled(arr[qk:], 0, nk, per, dv)])
    if stem.endswith("in_proj_z"):
        return _tiled(arr, 0, nk, per, dv)
    if stem.endswith(("in_proj_a", "in_proj_b", "A_log", "dt_bias")):
        return _tiled(arr, 0, nk, per, 1)
    if stem.endswith("conv1d"):
        arr = arr.squeeze()
        return np.concatenate([arr[:qk], _tiled(arr[qk:], 0, nk, per, dv)])
    if stem.endswith("out_proj"):
        return _tiled(arr, 1, nk, per, dv)
    return arr


def _split_qkvz(arr: np.ndarray, cfg: dict) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3NextModel: [q, k, v, z] per key head -> (all q, all k, all v), all z."""
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    sizes = np.cumsum([dk, dk, nv // nk * dv])
    q, k, v, z = np.split(arr.reshape(nk, -1, arr.shape[-1]), sizes, axis=1)
    flat = [t.reshape(-1, arr.shape[-1]) for t in (q, k, v, z)]
    return np.concatenate(flat[:3]), flat[3]


def _delta_net_tensor(arch: str, stem: str, suffix: str, arr: np.ndarray, cfg: dict, legacy: bool = False):
    """(stem, suffix, array) pieces after the converter's delta-net changes (`legacy`: Qwen3-Next's in_proj_qkvz
    kept whole, as `ssm_in`, the way older converters wrote it)."""
    if arch != "qwen3next":
        arr = _reorder_values(stem, arr, cfg)
    if stem.endswith(".A_log"):
        arr = -np.exp(arr)
    elif stem.endswith(".dt_bias"):
        stem, suffix = stem.removesuffix(".dt_bias") + ".dt_proj", "bias"
    elif "conv1d" in stem:
        arr = arr.squeeze()
    elif stem.endswith("norm") and not stem.endswith("linear_attn.norm"):
        arr = arr + 1
    if stem.endswith("in_proj_qkvz") and not legacy:
        qkv, z = _split_qkvz(arr, cfg)
        base = stem.removesuffix("in_proj_qkvz")
        return [(base + "in_proj_qkv", suffix, qkv), (base + "in_proj_z", suffix, z)]
    return [(stem, suffix, arr)]


def _stack_experts(state: dict, cfg: dict) -> None:
    """Qwen2MoeModel: per-expert weights stacked [E, out, in] under `mlp.experts.<w>`."""
    n = cfg.get("num_experts") or 0
    for layer in range(cfg["num_hidden_layers"] if n else 0):
        base = f"model.layers.{layer}.mlp.experts"
        for w in ("gate_proj", "up_proj", "down_proj"):
            state[f"{base}.{w}.weight"] = np.stack([state.pop(f"{base}.{e}.{w}.weight") for e in range(n)])


def _mtp_block(w, cfg: dict, state: dict) -> None:
    """_Qwen35MtpMixin's multi-token-prediction block after the decoder layers (block_count counts it): a full
    attention layer with the checkpoint's MLP, plus its own input projection and norms (random here: a tiny
    checkpoint has none, and the forward never reads them)."""
    n, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    rng = np.random.default_rng(1)
    last_full = max(i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention")
    w.add_nextn_predict_layers(1)
    names = gguf_tensor_names("qwen35", n + 1)
    for hf_name, arr in state.items():
        prefix = f"model.layers.{last_full}."
        if hf_name.startswith(prefix):
            stem, suffix = hf_name.removeprefix(prefix).rsplit(".", 1)
            pieces = _delta_net_tensor("qwen35", f"model.layers.{n}.{stem}", suffix, arr + 0.5, cfg)
            for stem, suffix, piece in pieces:
                w.add_tensor(f"{names.get_name(stem)}.{suffix}", piece)
    w.add_tensor(f"blk.{n}.nextn.eh_proj.weight", rng.normal(size=(hidden, 2 * hidden)).astype(np.float32))
    for norm in ("enorm", "hnorm", "shared_head_norm"):
        w.add_tensor(f"blk.{n}.nextn.{norm}.weight", rng.uniform(0.5, 1.5, hidden).astype(np.float32))


def gguf_tensor_names(arch: str, n_blocks: int):
    import gguf

    return gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), n_blocks)


def convert_hybrid(
    hf_dir: Path,
    out_path: Path,
    arch: str,
    name: str,
    pre: str,
    file_arch,
    qtype,
    dequantized,
    legacy: bool = False,
    mtp: bool = False,
):
    """gguf_convert.convert for the architectures in ARCHS (same arguments; `legacy`: see _delta_net_tensor; `mtp`:
    a Qwen3.5 file with a multi-token-prediction block, see _mtp_block)."""
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    if mtp:  # block_count counts the MTP block
        cfg["block_count"] = cfg["num_hidden_layers"] + 1
    if arch == "nemotron_h":  # NemotronHModel: one layer per block type
        cfg["num_hidden_layers"] = len(cfg["layers_block_type"])
    w = _HybridWriter(str(out_path), file_arch or arch, qtype=qtype, dequantized=dequantized)
    w.add_name(name)
    _metadata(w, arch, cfg)

    _bpe_vocab(w, hf_dir, pre)
    w.add_file_type(0 if qtype is None or dequantized else _FILE_TYPES[qtype.name])
    state = {k: v.astype(np.float32) for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    _stack_experts(state, cfg)
    names = gguf_tensor_names(arch, cfg["num_hidden_layers"])
    for hf_name, arr in state.items():
        stem, suffix = hf_name.rsplit(".", 1) if hf_name.endswith((".weight", ".bias")) else (hf_name, None)
        if arch in DELTA_NET:
            pieces = _delta_net_tensor(arch, stem, suffix, arr, cfg, legacy)
        elif arch == "nemotron_h":
            pieces = [_nemotron_h_tensor(stem, suffix, arr, cfg)]
        else:
            pieces = [(stem, suffix, arr.squeeze(1) if stem.endswith("conv.conv") else arr)]
        for stem, suffix, arr in pieces:
            gguf_name = names.get_name(stem)
            assert gguf_name is not None, stem
            w.add_tensor(gguf_name if suffix is None else f"{gguf_name}.{suffix}", arr)
    if mtp:
        _mtp_block(w, cfg, state)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path
