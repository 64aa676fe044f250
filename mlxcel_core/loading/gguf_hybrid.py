"""GGUF hybrid recurrent families: `qwen3next`, `qwen35`, `qwen35moe` (gated delta-net + gated attention), `lfm2`
(short convolution + attention) and `nemotron_h` (Mamba2 + attention + MLP blocks): their config from the metadata
and the converter's tensor changes undone. MLX is imported on use: gguf_arch (which reads the config side) stays
importable without it.

llama.cpp's converter (Qwen3NextModel, Qwen3_5TextModel, Qwen3_5MoeTextModel, LFM2Model) changes these tensors:
- `A_log` is stored as `ssm_a` = -exp(A_log) (a bare tensor, no `.weight`): log(-ssm_a) here;
- `dt_bias` is stored as `ssm_dt.bias`; the depthwise convolutions [C, 1, K] are squeezed to [C, K];
- the (1 + weight) norms (layer norms, final norm, q/k norms; not the delta-net's gated norm) get the 1 added;
- Qwen3-Next's `in_proj_qkvz` (q, k, v, z grouped per key head) is split into `attn_qkv` (all q, all k, all v: the
  convolution's channel order) and `attn_gate` (z): merged back here (older files keep it whole as `ssm_in`);
- Qwen3.5 files keep the multi-token-prediction block after the decoder layers: dropped, as llama.cpp skips it;
- Qwen3.5 with fewer key than value heads has its value heads reordered from grouped by key head to tiled
  (`_LinearAttentionVReorderBase`: rows of the v part of `attn_qkv`, `attn_gate`, `ssm_alpha`, `ssm_beta`, `ssm_a`,
  `ssm_dt`, the convolution's v channels, and the columns of `ssm_out`): put back in grouped order here.
The gated attention's q projection keeps each head's query and output gate side by side, as in the checkpoint.
Nemotron-H's converter (NemotronHModel over Mamba2Model) stores A as -exp(A_log) and D as [H, 1] columns, the gated
norm as [groups, size], dt_bias as `ssm_dt.bias`, the convolution squeezed, and the attention's q/k rows interleaved.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import CorruptModelError, UnsupportedModelError

if TYPE_CHECKING:
    import mlx.core as mx

LINEAR, FULL = "linear_attention", "full_attention"
NEMOTRON_MAMBA = LINEAR  # models/nemotron_h.py's name for a Mamba2 block
CONV = "conv"
# Our (1 + weight) norms of the Qwen3-Next family (models/qwen3_next.SHIFTED_NORMS): stored with the 1 added.
SHIFTED_NORMS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "model.norm.weight",
    "q_norm.weight",
    "k_norm.weight",
)


# --- config ----------------------------------------------------------------------------------------------------


def _int(m, key: str) -> int:
    return int(m.need(key))


def _layer_types(m, n: int, full: str, other: str, is_full) -> list[str]:
    return [full if is_full(i) else other for i in range(n)]


def _delta_net(config: dict, m) -> None:
    """The gated delta-net's sizes (the `ssm.*` keys Qwen3NextModel writes) and the layer kinds: a layer with
    attention projections is full attention, as llama.cpp's loader reads each layer's tensors."""
    v_heads, inner = _int(m, "ssm.time_step_rank"), _int(m, "ssm.inner_size")
    if inner % v_heads:
        raise CorruptModelError(f"GGUF {m.arch}.ssm.inner_size {inner} is not a multiple of {v_heads} value heads")
    config.update(
        linear_conv_kernel_dim=_int(m, "ssm.conv_kernel"),
        linear_key_head_dim=_int(m, "ssm.state_size"),
        linear_num_key_heads=_int(m, "ssm.group_count"),
        linear_num_value_heads=v_heads,
        linear_value_head_dim=inner // v_heads,
    )
    n = config["num_hidden_layers"]
    config["layer_types"] = _layer_types(m, n, FULL, LINEAR, lambda i: f"blk.{i}.attn_q.weight" in m.names)
    head_dim = config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    rope_dims = m.get("rope.dimension_count")
    config["partial_rotary_factor"] = 0.25 if rope_dims is None else int(rope_dims) / head_dim


def _shared_expert_moe(config: dict, m) -> None:
    """Routed experts (top k renormalized: llama.cpp's qwen3next / qwen35moe graphs always do) and the shared
    expert, whose width llama.cpp takes from the feed-forward length when the file has no shared one."""
    config["num_experts"] = _int(m, "expert_count")
    config["num_experts_per_tok"] = _int(m, "expert_used_count")
    config["moe_intermediate_size"] = _int(m, "expert_feed_forward_length")
    shared = m.get("expert_shared_feed_forward_length", config.get("intermediate_size"))
    if shared is None:
        raise CorruptModelError(f"GGUF metadata has no '{m.arch}.expert_shared_feed_forward_length'")
    config["shared_expert_intermediate_size"] = int(shared)
    config["norm_topk_prob"] = True
    config["decoder_sparse_step"], config["mlp_only_layers"] = 1, []


def qwen3_next_config(config: dict, m) -> None:
    _delta_net(config, m)
    _shared_expert_moe(config, m)


def _without_mtp(config: dict, m) -> None:
    """Qwen3.5 files keep the multi-token-prediction block(s) after the decoder layers (`nextn_predict_layers`;
    `block_count` counts them): llama.cpp's forward skips them, and so do we (fix_delta_net drops their tensors)."""
    nextn = int(m.get("nextn_predict_layers", 0) or 0)
    if nextn >= config["num_hidden_layers"]:
        raise CorruptModelError(f"GGUF {m.arch}.nextn_predict_layers {nextn} leaves no decoder layer")
    config["num_hidden_layers"] -= nextn


def qwen3_5_config(config: dict, m) -> None:
    _without_mtp(config, m)
    _delta_net(config, m)
    if m.get("expert_count", 0):
        raise UnsupportedModelError(f"GGUF {m.arch} with experts is not supported (the MoE one is qwen35moe)")
    config["num_experts"] = 0


def qwen3_5_moe_config(config: dict, m) -> None:
    _without_mtp(config, m)
    _delta_net(config, m)
    _shared_expert_moe(config, m)
    config["intermediate_size"] = 0  # Qwen3.5-MoE has no dense MLP


def lfm2_config(config: dict, m) -> None:
    """LFM2Model writes the KV head count per layer, 0 for a convolution layer, and the feed-forward width after
    transformers' adjustment."""
    n = config["num_hidden_layers"]
    kv = m.array("attention.head_count_kv")
    if kv is not None and len(kv) != n:
        raise CorruptModelError(f"GGUF {m.arch}.attention.head_count_kv has {len(kv)} entries for {n} layers")
    config["layer_types"] = _layer_types(m, n, FULL, CONV, lambda i: kv is None or bool(kv[i]))
    config["conv_L_cache"] = _int(m, "shortconv.l_cache")
    config["norm_eps"] = config["rms_norm_eps"]
    config["block_auto_adjust_ff_dim"] = False
    config["block_ff_dim"] = None
    first_conv = next((i for i, t in enumerate(config["layer_types"]) if t == CONV), None)
    config["conv_bias"] = first_conv is not None and f"blk.{first_conv}.shortconv.in_proj.bias" in m.names


def nemotron_h_config(config: dict, m) -> None:
    """Nemotron-H (NemotronHModel over GraniteHybridModel / Mamba2Model): the Mamba2 sizes from the `ssm.*` keys;
    each block's kind from its tensors (Mamba2 `ssm_in`, attention `attn_q`, MLP `ffn_up`). The file stores neither
    `time_step_limit` nor `chunk_size`: transformers' defaults hold (what the released configs use; the chunk size
    changes only the summation order)."""
    heads, inner = _int(m, "ssm.time_step_rank"), _int(m, "ssm.inner_size")
    if inner % heads:
        raise CorruptModelError(f"GGUF {m.arch}.ssm.inner_size {inner} is not a multiple of {heads} heads")
    config.update(
        mamba_num_heads=heads,
        mamba_head_dim=inner // heads,
        n_groups=_int(m, "ssm.group_count"),
        ssm_state_size=_int(m, "ssm.state_size"),
        conv_kernel=_int(m, "ssm.conv_kernel"),
        layer_norm_epsilon=config["rms_norm_eps"],
    )
    kinds = []
    for i in range(config["num_hidden_layers"]):
        parts = [p for p in ("ssm_in", "attn_q", "ffn_up", "ffn_gate_inp") if f"blk.{i}.{p}.weight" in m.names]
        if parts[:1] not in (["ssm_in"], ["attn_q"], ["ffn_up"]):
            raise UnsupportedModelError(f"GGUF {m.arch} block {i} ({parts or 'no known tensors'}) is not supported")
        kinds.append({"ssm_in": NEMOTRON_MAMBA, "attn_q": FULL, "ffn_up": "mlp"}[parts[0]])
    config["layers_block_type"] = kinds

    def first(kind: str, part: str) -> bool:
        i = next((i for i, k in enumerate(kinds) if k == kind), None)
        return i is not None and f"blk.{i}.{part}.bias" in m.names

    config["use_conv_bias"] = first(NEMOTRON_MAMBA, "ssm_conv1d")
    config["use_bias"] = first(NEMOTRON_MAMBA, "ssm_in")
    config["mlp_bias"] = first("mlp", "ffn_up")


# --- tensor names ----------------------------------------------------------------------------------------------

_GATED_ATTENTION = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
}
# `ssm_dt.bias` lands on `linear_attn.dt.bias` and `fix_delta_net` renames it to dt_bias; `ssm_a` is bare.
_DELTA_NET = {
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_dt": "linear_attn.dt",
    "ssm_a": "linear_attn.A_log",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
}
_SHARED_EXPERT_MOE = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# The multi-token-prediction block's own tensors, named under its layer (past num_hidden_layers: dropped).
_NEXTN = {f"nextn.{p}": f"nextn.{p}" for p in ("eh_proj", "enorm", "hnorm", "shared_head_head", "shared_head_norm")}
_QWEN3_5 = {
    **_GATED_ATTENTION,
    **_DELTA_NET,
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    **_NEXTN,
}
# Checkpoint names (models/lfm2.py's sanitize maps them onto the stock blocks).
_LFM2 = {
    "attn_norm": "operator_norm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.out_proj",
    "attn_q_norm": "self_attn.q_layernorm",
    "attn_k_norm": "self_attn.k_layernorm",
    "shortconv.conv": "conv.conv",
    "shortconv.in_proj": "conv.in_proj",
    "shortconv.out_proj": "conv.out_proj",
    "ffn_norm": "ffn_norm",
    "ffn_gate": "feed_forward.w1",
    "ffn_up": "feed_forward.w3",
    "ffn_down": "feed_forward.w2",
}
LAYER_NAMES: dict[str, dict[str, str]] = {
    "qwen3_next": {
        **_GATED_ATTENTION,
        **_DELTA_NET,
        "ssm_in": "linear_attn.in_proj_qkvz",  # older files: the checkpoint's fused projection as it is
        "ssm_ba": "linear_attn.in_proj_ba",
        **_SHARED_EXPERT_MOE,
    },
    "qwen3_5": {**_QWEN3_5, "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"},
    "qwen3_5_moe": {**_QWEN3_5, **_SHARED_EXPERT_MOE},
    "lfm2": _LFM2,
    "nemotron_h": {
        "attn_norm": "norm",
        "ssm_in": "mixer.in_proj",
        "ssm_conv1d": "mixer.conv1d",
        "ssm_dt": "mixer.dt",
        "ssm_a": "mixer.A_log",
        "ssm_d": "mixer.D",
        "ssm_norm": "mixer.norm",
        "ssm_out": "mixer.out_proj",
        "attn_q": "mixer.q_proj",
        "attn_k": "mixer.k_proj",
        "attn_v": "mixer.v_proj",
        "attn_output": "mixer.o_proj",
        "ffn_up": "mixer.up_proj",
        "ffn_down": "mixer.down_proj",
    },
}
# Top-level tensors named differently from the common map, by our model_type.
TOP_NAMES: dict[str, dict[str, str]] = {
    "lfm2": {"token_embd_norm": "model.embedding_norm"},
    "nemotron_h": {"token_embd": "model.embeddings", "output_norm": "model.norm_f"},
}


# --- tensor fix-ups --------------------------------------------------------------------------------------------

_PARTS = ("weight", "scales", "biases")


def _take(out: dict[str, Any], stem: str) -> dict[str, mx.array]:
    """The arrays of one layer (`weight`, and `scales`/`biases` when quantized), removed from `out`."""
    parts = {p: out.pop(f"{stem}.{p}") for p in _PARTS if f"{stem}.{p}" in out}
    if "weight" not in parts:
        raise CorruptModelError(f"GGUF file has no tensor for {stem}")
    return parts


def _put(out: dict[str, Any], stem: str, parts: dict[str, mx.array]) -> None:
    for p, a in parts.items():
        out[f"{stem}.{p}"] = a


def _layout(parts: dict[str, mx.array], in_dims: int) -> tuple | None:
    """(group size, bits, has biases) of a quantized layer with `in_dims` inputs; None for a float one."""
    if "scales" not in parts:
        return None
    return in_dims // parts["scales"].shape[-1], parts["weight"].shape[-1] * 32 // in_dims, "biases" in parts


def _decoded(parts: dict[str, mx.array], in_dims: int, what: str) -> dict[str, mx.array]:
    """A quantized layer's float values (exactly what it computes with), for a change its layout cannot carry."""
    import mlx.core as mx

    layout = _layout(parts, in_dims)
    if layout is None:
        return parts
    group, bits, biased = layout
    if not biased:
        raise UnsupportedModelError(f"GGUF {what} in a quantization without biases cannot be reordered")
    w = mx.dequantize(parts["weight"], parts["scales"], parts["biases"], group_size=group, bits=bits)
    return {"weight": w}


def _rows(parts: dict[str, mx.array], index: np.ndarray) -> dict[str, mx.array]:
    """Rows (output features) reordered: weight, scales and biases are all row-major."""
    import mlx.core as mx

    idx = mx.array(index)
    return {p: mx.take(a, idx, axis=0) for p, a in parts.items()}


def _concat_rows(pieces: list[dict[str, mx.array]], in_dims: int, what: str) -> dict[str, mx.array]:
    """Layers stacked along their outputs: as they are when all share one layout, else as float values."""
    import mlx.core as mx

    layouts = {_layout(p, in_dims) for p in pieces}
    if len(layouts) != 1:
        pieces = [_decoded(p, in_dims, what) for p in pieces]
    return {k: mx.concatenate([p[k] for p in pieces], axis=0) for k in pieces[0]}


def grouped_heads(num_k: int, per_k: int, head_dim: int) -> np.ndarray:
    """Index that undoes the converter's value-head reorder: row j of the result is row index[j] of the file.

    The file holds value head (i * per_k + j) of key head i at tiled position (j * num_k + i)."""
    position = (np.arange(per_k)[None, :] * num_k + np.arange(num_k)[:, None]).reshape(-1)
    return (position[:, None] * head_dim + np.arange(head_dim)[None, :]).reshape(-1)


def _columns(parts: dict[str, mx.array], index: np.ndarray, block: int, in_dims: int, what: str):
    """Input columns reordered by `index`, which moves whole blocks of `block` columns: a quantized layer keeps its
    layout when a block is whole groups and whole 32-bit words, else it becomes float."""
    import mlx.core as mx

    layout = _layout(parts, in_dims)
    if layout is not None:
        group, bits, _ = layout
        if block % group == 0 and (block * bits) % 32 == 0:
            blocks = index[::block] // block
            out = {}
            for p, a in parts.items():
                width = a.shape[-1] // (in_dims // block)
                cols = (blocks[:, None] * width + np.arange(width)[None, :]).reshape(-1)
                out[p] = mx.take(a, mx.array(cols), axis=-1)
            return out
        parts = _decoded(parts, in_dims, what)
    return {"weight": mx.take(parts["weight"], mx.array(index), axis=-1)}


def _float(out: dict[str, Any], name: str) -> mx.array:
    if f"{name.rsplit('.', 1)[0]}.scales" in out:
        raise UnsupportedModelError(f"GGUF tensor for {name} is quantized; llama.cpp's converter keeps it in float")
    return out[name]


def _sizes(config: dict) -> tuple[int, int, int, int, int]:
    nk, nv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    return nk, nv // nk, config["linear_key_head_dim"], config["linear_value_head_dim"], config["hidden_size"]


def _merge_qkvz(out: dict[str, Any], stem: str, config: dict) -> None:
    """`in_proj_qkv` (all q, all k, all v) and `in_proj_z` back into the checkpoint's `in_proj_qkvz`: per key head,
    its q, k, v and z rows."""
    nk, per, dk, dv, hidden = _sizes(config)
    qkv, z = _take(out, f"{stem}.in_proj_qkv"), _take(out, f"{stem}.in_proj_z")
    merged = _concat_rows([qkv, z], hidden, f"{stem}.in_proj_qkvz")
    key_dim, value_dim = nk * dk, nk * per * dv
    heads = []
    for h in range(nk):
        for start, size in ((0, dk), (key_dim, dk), (2 * key_dim, per * dv), (2 * key_dim + value_dim, per * dv)):
            heads.append(np.arange(start + h * size, start + (h + 1) * size))
    _put(out, f"{stem}.in_proj_qkvz", _rows(merged, np.concatenate(heads)))


def _ungroup_values(out: dict[str, Any], stem: str, config: dict) -> None:
    """Undo Qwen3.5's value-head reorder (only written when there are fewer key than value heads)."""
    import mlx.core as mx

    nk, per, dk, dv, hidden = _sizes(config)
    if per == 1:
        return
    qk = np.arange(2 * nk * dk)
    values, heads = grouped_heads(nk, per, dv), grouped_heads(nk, per, 1)
    _put(out, f"{stem}.in_proj_qkv", _rows(_take(out, f"{stem}.in_proj_qkv"), np.concatenate([qk, len(qk) + values])))
    _put(out, f"{stem}.in_proj_z", _rows(_take(out, f"{stem}.in_proj_z"), values))
    for name in ("in_proj_a", "in_proj_b"):
        _put(out, f"{stem}.{name}", _rows(_take(out, f"{stem}.{name}"), heads))
    for name in ("A_log", "dt_bias"):
        out[f"{stem}.{name}"] = _float(out, f"{stem}.{name}")[mx.array(heads)]
    conv = _float(out, f"{stem}.conv1d.weight")
    out[f"{stem}.conv1d.weight"] = conv[mx.array(np.concatenate([qk, len(qk) + values]))]
    out_proj = _take(out, f"{stem}.out_proj")
    _put(out, f"{stem}.out_proj", _columns(out_proj, values, dv, nk * per * dv, f"{stem}.out_proj"))


def _fix_delta_layer(out: dict[str, Any], stem: str, config: dict) -> None:
    import mlx.core as mx

    dt = out.pop(f"{stem}.dt.bias", None)
    if dt is None:
        raise CorruptModelError(f"GGUF file has no ssm_dt.bias for {stem}")
    out[f"{stem}.dt_bias"] = dt
    a = _float(out, f"{stem}.A_log").astype(mx.float32)
    if bool(mx.any(a >= 0).item()):
        raise CorruptModelError(f"GGUF ssm_a for {stem} holds a non-negative value (the converter stores -exp(A_log))")
    out[f"{stem}.A_log"] = mx.log(-a)
    conv = _float(out, f"{stem}.conv1d.weight")
    if conv.ndim == 3:
        conv = conv.reshape(conv.shape[0], conv.shape[-1])
    out[f"{stem}.conv1d.weight"] = conv
    if config["model_type"] == "qwen3_next":
        if f"{stem}.in_proj_qkv.weight" in out:
            _merge_qkvz(out, stem, config)
    else:
        _ungroup_values(out, stem, config)
    out[f"{stem}.conv1d.weight"] = out[f"{stem}.conv1d.weight"][:, None, :]


def fix_delta_net(out: dict[str, Any], config: dict) -> None:
    """The Qwen3-Next / Qwen3.5 converter's changes undone on our parameter names (gguf_names.FIXUPS); the
    multi-token-prediction block's tensors dropped."""
    n = config["num_hidden_layers"]
    for name in [k for k in out if k.startswith("model.layers.") and int(k.split(".")[2]) >= n]:
        del out[name]
    for i, kind in enumerate(config["layer_types"]):
        if kind == LINEAR:
            _fix_delta_layer(out, f"model.layers.{i}.linear_attn", config)
    for name in list(out):
        if name.endswith(SHIFTED_NORMS):
            out[name] = _float(out, name) - 1
        elif name.endswith("mlp.shared_expert_gate.weight") and out[name].ndim == 1:
            out[name] = out[name][None, :]  # llama.cpp reads it as [n_embd]; our layer is Linear(hidden, 1)


def fix_lfm2(out: dict[str, Any], config: dict) -> None:
    """LFM2Model's squeezed short-convolution weights back to [C, 1, K]."""
    for i, kind in enumerate(config["layer_types"]):
        name = f"model.layers.{i}.conv.conv.weight"
        if kind == CONV:
            conv = _float(out, name)
            out[name] = conv[:, None, :] if conv.ndim == 2 else conv


def fix_nemotron_h(out: dict[str, Any], config: dict) -> None:
    """Mamba2Model's changes undone: A stored as -exp(A_log) [H, 1], D as [H, 1], the gated norm as [groups, size],
    dt_bias as `ssm_dt.bias`, the convolution squeezed to [C, K]. (The attention's q/k row interleave, which
    GraniteHybridModel applies, is undone by gguf_names.PERMUTED_QK.)"""
    import mlx.core as mx

    for i, kind in enumerate(config["layers_block_type"]):
        if kind != NEMOTRON_MAMBA:
            continue
        stem = f"model.layers.{i}.mixer"
        dt = out.pop(f"{stem}.dt.bias", None)
        if dt is None:
            raise CorruptModelError(f"GGUF file has no ssm_dt.bias for {stem}")
        out[f"{stem}.dt_bias"] = dt
        a = _float(out, f"{stem}.A_log").astype(mx.float32).reshape(-1)
        if bool(mx.any(a >= 0).item()):
            raise CorruptModelError(
                f"GGUF ssm_a for {stem} holds a non-negative value (the converter stores -exp(A_log))"
            )
        out[f"{stem}.A_log"] = mx.log(-a)
        for name in ("D", "norm.weight"):
            out[f"{stem}.{name}"] = _float(out, f"{stem}.{name}").reshape(-1)
        conv = _float(out, f"{stem}.conv1d.weight")
        out[f"{stem}.conv1d.weight"] = conv[:, None, :] if conv.ndim == 2 else conv


FIXUPS = {
    "qwen3_next": fix_delta_net,
    "qwen3_5": fix_delta_net,
    "qwen3_5_moe": fix_delta_net,
    "lfm2": fix_lfm2,
    "nemotron_h": fix_nemotron_h,
}
