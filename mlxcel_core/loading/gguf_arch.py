"""GGUF architectures: what each `general.architecture` becomes in our registry, and its config from the metadata.

llama.cpp's convert_hf_to_gguf.py writes the hyper-parameters as `<arch>.<key>` metadata and changes some
tensors on the way (see gguf_names.py for the tensor side). An architecture listed here loads exactly; any
other is refused with the list of these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..errors import CorruptModelError, UnsupportedModelError
from . import gguf_gemma4, gguf_hybrid, gguf_mla
from .gguf_hparams import GEMMA_FULL, GEMMA_SLIDING, Meta, as_list, as_scalar, sliding_layer_types

# Our model types that rotate part of each head (`partial_rotary_factor`).
PARTIAL_ROTARY = {"phi3", "qwen3_next", "qwen3_5", "qwen3_5_moe", "glm4_moe"}
# Our model types whose `extra` reads the head sizes and rotary dims itself (deepseek2's MLA: key_length is the
# latent's, not a head's).
OWN_GEOMETRY = {"deepseek_v3"}


@dataclass(frozen=True)
class ArchSpec:
    """`model_type`: our registry's (the llama architecture becomes mixtral when it has experts); `extra` adds the
    architecture's own hyper-parameters to the config; `base_meta`, where given, is the metadata the generic config
    reads (per-layer arrays that `extra` reads itself reduced)."""

    model_type: str
    extra: Callable[[dict, "Meta"], None] | None = None
    base_meta: Callable[["Meta"], "Meta"] | None = None


def _uniform(m: Meta, key: str, name: str) -> int:
    """A per-layer array (some converters write one) that must hold a single value for our models."""
    value = m.meta.get(f"{m.arch}.{key}")
    if value is None:
        return int(m.need(key))
    values = set(as_list(value)) if hasattr(value, "tolist") or isinstance(value, list) else {as_scalar(value)}
    values = values - {0} or values  # 0: a layer without attention (LFM2's convolution layers)
    if len(values) != 1:
        raise UnsupportedModelError(f"GGUF {m.arch} with a per-layer {name} is not supported")
    return int(values.pop())


def _base_config(m: Meta, spec: ArchSpec, eps_default: float) -> dict[str, Any]:
    heads = _uniform(m, "attention.head_count", "head count")
    config: dict[str, Any] = {
        "model_type": spec.model_type,
        "hidden_size": int(m.need("embedding_length")),
        "num_hidden_layers": int(m.need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": _uniform(m, "attention.head_count_kv", "KV head count")
        if m.has("attention.head_count_kv")
        else heads,
        "rms_norm_eps": float(m.get("attention.layer_norm_rms_epsilon", eps_default)),
        "rope_theta": float(m.get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(m.get("context_length", 4096)),
        "vocab_size": int(m.get("vocab_size", len(m.meta.get("tokenizer.ggml.tokens", [])))),
        "tie_word_embeddings": "output.weight" not in m.names,
    }
    if m.has("feed_forward_length"):
        config["intermediate_size"] = _uniform(m, "feed_forward_length", "feed-forward length")
    key_len, value_len = m.get("attention.key_length"), m.get("attention.value_length")
    if key_len is not None and spec.model_type not in OWN_GEOMETRY:
        if value_len is not None and int(value_len) != int(key_len):
            raise UnsupportedModelError(f"GGUF {m.arch} with key length {key_len} != value length {value_len}")
        config["head_dim"] = int(key_len)
    head_dim = config.get("head_dim", config["hidden_size"] // heads)
    rope_dims = m.get("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim and spec.model_type not in OWN_GEOMETRY:
        if spec.model_type not in PARTIAL_ROTARY:
            raise UnsupportedModelError(
                f"GGUF {m.arch} with partial rotary embedding ({rope_dims} of {head_dim} dims) is not supported"
            )
        config["partial_rotary_factor"] = int(rope_dims) / head_dim
    scaling = _rope_scaling(m, config)
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


def _rope_scaling(m: Meta, config: dict[str, Any]) -> dict[str, Any] | None:
    kind = m.get("rope.scaling.type")
    factor = m.get("rope.scaling.factor")
    original = m.get("rope.scaling.original_context_length")
    if "rope_freqs.weight" in m.names:
        # llama.cpp stores Llama 3's rope scaling as per-dimension period factors (theta_i / f_i): exactly
        # longrope with equal short and long factors and no attention factor.
        return {"rope_type": "rope_freqs", "original_max_position_embeddings": config["max_position_embeddings"]}
    if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        out = {"rope_type": "yarn", "factor": float(factor)}
        if original is not None:
            out["original_max_position_embeddings"] = int(original)
        for ours, key in (
            ("beta_fast", "rope.scaling.yarn_beta_fast"),
            ("beta_slow", "rope.scaling.yarn_beta_slow"),
            ("attention_factor", "rope.scaling.attn_factor"),
        ):
            if m.get(key) is not None:
                out[ours] = float(m.get(key))
        return out
    raise UnsupportedModelError(f"GGUF rope scaling '{kind}' is not supported (supported: linear, yarn, rope_freqs)")


def _moe(config: dict, m: Meta, experts_key: str = "num_local_experts") -> None:
    config[experts_key] = int(m.need("expert_count"))
    config["num_experts_per_tok"] = int(m.need("expert_used_count"))


def _llama(config: dict, m: Meta) -> None:
    if m.get("expert_count", 0):  # Mixtral: the llama architecture with experts
        config["model_type"] = "mixtral"
        _moe(config, m)
        if m.get("expert_feed_forward_length") is not None:
            config["intermediate_size"] = int(m.get("expert_feed_forward_length"))


def _qwen3_moe(config: dict, m: Meta) -> None:
    _moe(config, m, "num_experts")
    config["moe_intermediate_size"] = int(m.need("expert_feed_forward_length"))
    config.setdefault("intermediate_size", config["moe_intermediate_size"])
    # llama.cpp's qwen3moe graph renormalizes the top-k weights (the published Qwen3-MoE configs say so too).
    config["norm_topk_prob"] = bool(m.get("expert_weights_norm", True))


def _gemma_common(config: dict, m: Meta, layers_27b: int, final_softcap: float | None) -> None:
    config["sliding_window"] = int(m.need("attention.sliding_window"))
    head_dim = config.setdefault("head_dim", 256)
    # llama.cpp scales queries by 1/sqrt(head_dim), except the 27B models: 1/sqrt(hidden / heads).
    big = config["num_hidden_layers"] == layers_27b
    config["query_pre_attn_scalar"] = config["hidden_size"] / config["num_attention_heads"] if big else head_dim
    config["final_logit_softcapping"] = m.get("final_logit_softcapping", final_softcap)


def _gemma2(config: dict, m: Meta) -> None:
    _gemma_common(config, m, layers_27b=46, final_softcap=30.0)  # llama.cpp's (and Gemma2Config's) defaults
    config["attn_logit_softcapping"] = m.get("attn_logit_softcapping", 50.0)
    sliding_layer_types(config, m, 2)


def _gemma3(config: dict, m: Meta) -> None:
    _gemma_common(config, m, layers_27b=62, final_softcap=None)
    sliding_layer_types(config, m, 6)
    config["rope_local_base_freq"] = 10000.0  # llama.cpp's fixed base for the sliding layers


def _phi3(config: dict, m: Meta) -> None:
    window = m.get("attention.sliding_window")
    config["sliding_window"] = int(window) if window else None
    original = m.get("rope.scaling.original_context_length")
    if "rope_factors_long.weight" in m.names:
        config["rope_scaling"] = {"rope_type": "longrope_tensors"}  # factors come from the tensors (gguf_names)
        config["original_max_position_embeddings"] = int(original or config["max_position_embeddings"])
        if m.get("rope.scaling.attn_factor") is not None:
            config["rope_scaling"]["attention_factor"] = float(m.get("rope.scaling.attn_factor"))


def _granite(config: dict, m: Meta) -> None:
    config["embedding_multiplier"] = float(m.get("embedding_scale", 1.0))
    head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    # llama.cpp's default when the key is absent: 1/sqrt(head_dim)
    config["attention_multiplier"] = float(m.get("attention.scale", head_dim**-0.5))
    config["residual_multiplier"] = float(m.get("residual_scale", 1.0))
    config["logits_scaling"] = float(m.get("logit_scale", 1.0))


def _smollm3(config: dict, m: Meta) -> None:
    config["no_rope_layer_interval"] = 4  # llama.cpp's fixed step: every 4th layer applies no RoPE


def _olmo2(config: dict, m: Meta) -> None:
    """OLMo 2 (no sliding window) and OLMo 3 (sliding layers) share llama.cpp's olmo2 architecture; our olmo3
    model with every layer global is OLMo 2."""
    window = m.get("attention.sliding_window")
    config["sliding_window"] = int(window) if window else None
    if window:
        sliding_layer_types(config, m, 4)
    else:
        config["layer_types"] = [GEMMA_FULL] * config["num_hidden_layers"]
    # One base for both layer types (the file has one); the rope scaling (YaRN) is the global layers' alone.
    theta = config["rope_theta"]
    config["rope_parameters"] = {
        GEMMA_SLIDING: {"rope_type": "default", "rope_theta": theta},
        GEMMA_FULL: {"rope_type": "default", **config.pop("rope_scaling", {}), "rope_theta": theta},
    }


def _gpt_oss(config: dict, m: Meta) -> None:
    _moe(config, m)
    config["intermediate_size"] = int(m.need("expert_feed_forward_length"))
    config["sliding_window"] = int(m.need("attention.sliding_window"))
    sliding_layer_types(config, m, 2)
    scaling = config.pop("rope_scaling", None)
    if scaling is None:
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": config["rope_theta"]}
    else:  # gpt-oss's YaRN: GptOssConfig's betas and no truncation (the file stores factor and context only)
        config["rope_scaling"] = {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, **scaling}


ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec("llama", extra=_llama),
    "qwen2": ArchSpec("qwen2"),
    "qwen3": ArchSpec("qwen3"),
    "qwen3moe": ArchSpec("qwen3_moe", extra=_qwen3_moe),
    "gemma2": ArchSpec("gemma2", extra=_gemma2),
    "gemma3": ArchSpec("gemma3_text", extra=_gemma3),
    "phi3": ArchSpec("phi3", extra=_phi3),
    "granite": ArchSpec("granite", extra=_granite),
    "smollm3": ArchSpec("smollm3", extra=_smollm3),
    "olmo2": ArchSpec("olmo3", extra=_olmo2),
    "gpt-oss": ArchSpec("gpt_oss", extra=_gpt_oss),
    "qwen3next": ArchSpec("qwen3_next", extra=gguf_hybrid.qwen3_next_config),
    "qwen35": ArchSpec("qwen3_5", extra=gguf_hybrid.qwen3_5_config),
    "qwen35moe": ArchSpec("qwen3_5_moe", extra=gguf_hybrid.qwen3_5_moe_config),
    "lfm2": ArchSpec("lfm2", extra=gguf_hybrid.lfm2_config),
    "nemotron_h": ArchSpec("nemotron_h", extra=gguf_hybrid.nemotron_h_config),
    "deepseek2": ArchSpec("deepseek_v3", extra=gguf_mla.deepseek2_config),
    "glm4moe": ArchSpec("glm4_moe", extra=gguf_mla.glm4moe_config),
    "gemma4": ArchSpec("gemma4_text", extra=gguf_gemma4.gemma4_extra, base_meta=gguf_gemma4.gemma4_base_meta),
    "llama4": ArchSpec("llama4_text", extra=gguf_gemma4.llama4_extra),
    "mistral3": ArchSpec("ministral3", extra=gguf_gemma4.ministral3_extra),
}
EPS_DEFAULT = {"gemma2": 1e-6, "gemma3": 1e-6}


def arch_spec(meta: dict[str, Any]) -> tuple[str, ArchSpec]:
    arch = as_scalar(meta.get("general.architecture"))
    spec = ARCHS.get(arch)
    if spec is None:
        raise UnsupportedModelError(
            f"GGUF architecture '{arch}' is not supported (supported: {', '.join(sorted(ARCHS))})"
        )
    return arch, spec


def gguf_config(meta: dict[str, Any], tensor_names) -> dict[str, Any]:
    """Our config.json-style dict for a GGUF file's metadata and tensor names."""
    arch, spec = arch_spec(meta)
    m = Meta(meta, arch, set(tensor_names))
    try:
        config = _base_config(m if spec.base_meta is None else spec.base_meta(m), spec, EPS_DEFAULT.get(arch, 1e-5))
        if spec.extra is not None:
            spec.extra(config, m)
    except (TypeError, ValueError) as exc:
        raise CorruptModelError(f"GGUF metadata has a malformed {arch} hyper-parameter: {exc}") from exc
    return config


def rope_freqs_scaling(config: dict[str, Any], factors: np.ndarray) -> dict[str, Any]:
    """The `rope_freqs` tensor (llama.cpp's per-dimension period factors) as our longrope parameters."""
    values = [float(f) for f in np.asarray(factors, dtype=np.float32).reshape(-1)]
    return {
        "rope_type": "longrope",
        "short_factor": values,
        "long_factor": values,
        "factor": 1.0,
        "attention_factor": 1.0,
        "original_max_position_embeddings": config["rope_scaling"]["original_max_position_embeddings"],
    }


def attention_geometry(meta: dict[str, Any]) -> dict[str, int]:
    """head_dim / q_heads / kv_heads from `<arch>.attention.*` (head_dim: key_length, else embedding / heads), for
    any architecture (`mlxcel tune -m`). ValueError naming what is missing or what varies by layer."""
    arch = as_scalar(meta.get("general.architecture"))
    if not isinstance(arch, str):
        raise ValueError("the GGUF metadata has no general.architecture")

    def one(key: str):
        value = meta.get(f"{arch}.{key}")
        if isinstance(value, (list, np.ndarray)):  # per-layer values: one geometry only when they agree
            values = sorted(set(as_list(value)))
            if len(values) != 1:
                raise ValueError(f"{arch}.{key} differs between layers ({values}); pass the geometry flags")
            value = values[0]
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    q_heads = one("attention.head_count")
    if q_heads is None:
        raise ValueError(f"the GGUF metadata has no {arch}.attention.head_count")
    kv_heads = one("attention.head_count_kv") or q_heads
    head_dim = one("attention.key_length")
    if head_dim is None:
        hidden = one("embedding_length")
        if hidden is None:
            raise ValueError(f"the GGUF metadata has neither {arch}.attention.key_length nor {arch}.embedding_length")
        head_dim = hidden // q_heads
    return {"head_dim": head_dim, "q_heads": q_heads, "kv_heads": kv_heads}
