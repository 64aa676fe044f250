"""GGUF tensor names -> our (Hugging Face style) parameter names, undoing what llama.cpp's converter changed.

The converter (convert_hf_to_gguf.py) renames every tensor to `blk.N.<part>` / `<top>` and, by architecture:
- interleaves the q/k rows of each head (llama, mistral, mixtral, granite) for llama.cpp's RoPE: undone here;
- adds 1 to every `*norm.weight` (gemma2, gemma3; their norms compute (1 + w)): subtracted here;
- stacks MoE experts as `ffn_{gate,up,down}_exps` [E, out, in]: our `switch_mlp` layout, mapped as is;
- stores Llama 3's rope scaling as a `rope_freqs` tensor and Phi-3's LongRoPE as `rope_factors_*` tensors:
  turned back into the config's rope scaling.

A value is an mx.array or a quantized tensor (an object with `weight`, `scales`, `biases` and
`permute_rows(index)`); mx.load's quantized tensors arrive as `<name>.weight/.scales/.biases` arrays.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from ..errors import CorruptModelError, UnsupportedModelError
from . import gguf_gemma4, gguf_hybrid, gguf_mla
from .gguf_arch import rope_freqs_scaling

_ATTN = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
}
_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_LLAMA = {**_ATTN, "ffn_norm": "post_attention_layernorm", **_MLP}


def _experts(prefix: str) -> dict[str, str]:
    return {
        "ffn_gate_inp": f"{prefix}.gate",
        "ffn_gate_exps": f"{prefix}.switch_mlp.gate_proj",
        "ffn_up_exps": f"{prefix}.switch_mlp.up_proj",
        "ffn_down_exps": f"{prefix}.switch_mlp.down_proj",
    }


_GEMMA = {
    **_ATTN,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    **_MLP,
}
# Block tensor parts by our model_type.
LAYER_NAMES: dict[str, dict[str, str]] = {
    "llama": _LLAMA,
    "mixtral": {**_LLAMA, **_experts("block_sparse_moe")},
    "granite": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": {**_LLAMA, **_QK_NORM},
    "qwen3_moe": {**_LLAMA, **_QK_NORM, **_experts("mlp")},
    "gemma2": _GEMMA,
    "gemma3_text": {**_GEMMA, **_QK_NORM},
    "smollm3": _LLAMA,
    "olmo3": {
        **{k: v for k, v in _ATTN.items() if k != "attn_norm"},
        **_QK_NORM,
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
        **_MLP,
    },
    "gpt_oss": {
        **_ATTN,
        "attn_sinks": "self_attn.sinks",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_gate_inp": "mlp.router",
        "ffn_gate_exps": "mlp.experts.gate_proj",
        "ffn_up_exps": "mlp.experts.up_proj",
        "ffn_down_exps": "mlp.experts.down_proj",
    },
    "phi3": {
        "attn_norm": "input_layernorm",
        "attn_qkv": "self_attn.qkv_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_norm": "post_attention_layernorm",
        "ffn_up": "mlp.gate_up_proj",  # gate and up fused, gate first, as in the checkpoint
        "ffn_down": "mlp.down_proj",
    },
    **gguf_hybrid.LAYER_NAMES,
    **gguf_gemma4.LAYER_NAMES,
    **gguf_mla.LAYER_NAMES,
}
# Our model types whose converter interleaved the q/k rows (llama.cpp's LlamaModel.permute), and those whose
# converter added 1 to every norm weight.
PERMUTED_QK = {"llama", "mixtral", "granite", "smollm3", "ministral3", "nemotron_h"}
# Parameters stored as `<part>.weight` in GGUF that are bare tensors in our models.
BARE = {"attn_sinks"}
NORM_SHIFT = {"gemma2": 1.0, "gemma3_text": 1.0}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Top-level tensors named otherwise by our model_type.
TOP_NAMES: dict[str, dict[str, str]] = {**gguf_hybrid.TOP_NAMES, **gguf_gemma4.TOP_NAMES}
# Per model_type: a fix-up of the mapped weights (`fix(out, config)`) for converter changes beyond a name map.
FIXUPS: dict[str, Callable[[dict[str, Any], dict[str, Any]], None]] = {
    **gguf_hybrid.FIXUPS,
    **gguf_gemma4.FIXUPS,
    **gguf_mla.FIXUPS,
}
_SUFFIXES = ("weight", "scales", "biases", "bias")
# A block tensor's part may hold dots (`shortconv.in_proj`); one without a suffix (`ssm_a`) is a bare parameter.
_BLOCK = re.compile(r"^blk\.(\d+)\.([a-z0-9_.]+?)(?:\.(weight|scales|biases|bias))?$")
_TOP_RE = re.compile(r"^([a-z0-9_]+)\.(weight|scales|biases|bias)$")
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def unpermute_index(rows: int, n_heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permute: row j of the result is row index[j] of the GGUF tensor.

    The converter maps head h's rotate-half rows (i, half + i) to rows (2i, 2i + 1)."""
    head_dim = rows // n_heads
    if head_dim * n_heads != rows or head_dim % 2:
        raise CorruptModelError(f"a q/k tensor of {rows} rows does not split into {n_heads} heads of even size")
    per_head = np.arange(head_dim).reshape(head_dim // 2, 2).T.reshape(-1)  # [0, 2, 4, ..., 1, 3, 5, ...]
    return (np.arange(n_heads)[:, None] * head_dim + per_head[None, :]).reshape(-1)


def _permute_rows(value: Any, index: np.ndarray) -> Any:
    if isinstance(value, mx.array):
        return value[mx.array(index)]
    if hasattr(value, "permute_rows"):
        return value.permute_rows(index)
    raise CorruptModelError(f"cannot reorder the rows of a {type(value).__name__}")


def _emit(out: dict[str, Any], name: str, suffix: str, value: Any) -> None:
    """`name.suffix` = value; a quantized tensor object gives its weight, scales and biases."""
    if not isinstance(value, mx.array) and suffix != "weight":
        raise UnsupportedModelError(f"GGUF tensor for {name}.{suffix} is quantized; llama.cpp keeps it in float")
    if suffix == "weight" and not isinstance(value, mx.array) and hasattr(value, "scales"):
        out[f"{name}.weight"] = value.weight
        out[f"{name}.scales"] = value.scales
        if getattr(value, "biases", None) is not None:
            out[f"{name}.biases"] = value.biases
        return
    out[f"{name}.{suffix}"] = value


def _float_array(value: Any, what: str) -> mx.array:
    if not isinstance(value, mx.array):
        raise UnsupportedModelError(f"GGUF {what} is quantized; llama.cpp's converter keeps it in float")
    return value


def _rope_tensors(tensors: dict[str, Any], config: dict[str, Any]) -> None:
    """Fold the rope-factor tensors into the config's rope scaling."""
    scaling = config.get("rope_scaling") or {}
    if "rope_freqs.weight" in tensors:
        factors = np.array(_float_array(tensors["rope_freqs.weight"], "rope_freqs").astype(mx.float32))
        config["rope_scaling"] = rope_freqs_scaling(config, factors)
    if scaling.get("rope_type") == "longrope_tensors":
        long = _float_array(tensors["rope_factors_long.weight"], "rope_factors_long")
        short = _float_array(tensors.get("rope_factors_short.weight", long), "rope_factors_short")
        config["rope_scaling"] = {
            **{k: v for k, v in scaling.items() if k != "rope_type"},
            "rope_type": "longrope",
            "long_factor": np.array(long.astype(mx.float32)).tolist(),
            "short_factor": np.array(short.astype(mx.float32)).tolist(),
        }


def _block_value(config: dict, part: str, value: Any) -> Any:
    """Undo the q/k row interleave (weights, biases and mx.load's scales/biases alike: all are row-major)."""
    if config["model_type"] in PERMUTED_QK and part in ("attn_q", "attn_k"):
        heads = config["num_attention_heads"] if part == "attn_q" else config["num_key_value_heads"]
        rows = value.shape[0]
        return _permute_rows(value, unpermute_index(rows, heads))
    return value


def gguf_weights(tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Our parameter names for every tensor of the file (`config` from gguf_config); `config` takes the rope
    factors the tensors hold."""
    names = LAYER_NAMES[config["model_type"]]
    top = {**_TOP, **TOP_NAMES.get(config["model_type"], {})}
    shift = NORM_SHIFT.get(config["model_type"], 0.0)
    _rope_tensors(tensors, config)
    out: dict[str, Any] = {}
    for name, value in tensors.items():
        if name in _ROPE_TENSORS:
            continue
        if m := _BLOCK.match(name):
            layer, part, suffix = m.groups()
            target = names.get(part)
            if target is None:
                raise UnsupportedModelError(f"GGUF tensor '{name}' is not part of a {config['model_type']} model")
            value = _block_value(config, part, value)
            target = f"model.layers.{layer}.{target}"
            if suffix is None or (part in BARE and suffix == "weight"):
                out[target] = value
                continue
        elif (m := _TOP_RE.match(name)) and m.group(1) in top:
            part, suffix = m.groups()
            target = top[part]
        else:
            raise UnsupportedModelError(f"GGUF tensor '{name}' is not part of a {config['model_type']} model")
        if shift and part.endswith("norm") and suffix == "weight":
            value = _float_array(value, name) - shift
        _emit(out, target, suffix, value)
    fix = FIXUPS.get(config["model_type"])
    if fix is not None:
        fix(out, config)
    return out
