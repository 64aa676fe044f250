"""GGUF files through `mx.load`: llama-architecture tensors, config and tokenizer from the metadata.

MLX keeps Q4_0/Q4_1/Q8_0 tensors quantized (weight/scales/biases, group size 32) and reads
F16/F32 as plain arrays; our loader quantizes exactly the layers that arrive with scales.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..errors import CorruptModelError, UnsupportedModelError
from ..tokenizer import Tokenizer

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|scales|biases|bias)$")
_TOP = re.compile(r"^([a-z_]+)\.(weight|scales|biases|bias)$")

# llama.cpp pre-tokenizer names -> the split regex the HF tokenizer used.
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CONTROL, _USER_DEFINED = 3, 4


def read_gguf(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    try:
        return mx.load(str(path), return_metadata=True)
    except Exception as exc:
        first = (str(exc).strip() or type(exc).__name__).splitlines()[0]
        raise CorruptModelError(f"cannot read GGUF file {path}: {first}") from exc


def _scalar(value):
    return value.item() if isinstance(value, mx.array) else value


def gguf_config(meta: dict[str, Any], tensors: dict[str, mx.array]) -> dict[str, Any]:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise UnsupportedModelError(f"GGUF architecture '{arch}' is not supported (supported: llama)")

    def get(key, default=None):
        return _scalar(meta.get(f"{arch}.{key}", default))

    try:
        hidden = int(get("embedding_length"))
        heads = int(get("attention.head_count"))
        config = {
            "model_type": "llama",
            "hidden_size": hidden,
            "num_hidden_layers": int(get("block_count")),
            "intermediate_size": int(get("feed_forward_length")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(get("attention.head_count_kv", heads)),
            "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_theta": float(get("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(get("context_length", 4096)),
            "vocab_size": int(get("vocab_size", len(meta.get("tokenizer.ggml.tokens", [])))),
            "tie_word_embeddings": "output.weight" not in tensors,
        }
    except TypeError as exc:
        raise CorruptModelError(f"GGUF metadata is missing a {arch} hyper-parameter: {exc}") from exc
    head_dim = get("attention.key_length")
    if head_dim is not None:
        config["head_dim"] = int(head_dim)
    rope_dims = get("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != config.get("head_dim", hidden // heads):
        raise UnsupportedModelError(
            "GGUF with partial rotary embedding (rope.dimension_count < head_dim) is not supported"
        )
    scaling = get("rope.scaling.type")
    if scaling in ("linear",):
        config["rope_scaling"] = {"rope_type": scaling, "factor": float(get("rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise UnsupportedModelError(f"GGUF rope scaling '{scaling}' is not supported")
    if "rope_freqs.weight" in tensors:
        raise UnsupportedModelError("GGUF with rope_freqs (llama3 rope scaling) is not supported yet")
    return config


def _unpermute_rows(w: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's q/k row interleave so the HF (rotate-half) RoPE layout applies."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_weights(tensors: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
    out = {}
    for name, value in tensors.items():
        if m := _BLOCK.match(name):
            layer, part, suffix = m.groups()
            target = _LAYER_NAMES.get(part)
            if target is None:
                raise UnsupportedModelError(f"GGUF tensor '{name}' is not a llama tensor")
            if part == "attn_q":
                value = _unpermute_rows(value, config["num_attention_heads"])
            elif part == "attn_k":
                value = _unpermute_rows(value, config["num_key_value_heads"])
            out[f"model.layers.{layer}.{target}.{suffix}"] = value
        elif (m := _TOP.match(name)) and m.group(1) in _TOP_NAMES:
            out[f"{_TOP_NAMES[m.group(1)]}.{m.group(2)}"] = value
        else:
            raise UnsupportedModelError(f"GGUF tensor '{name}' is not a llama tensor")
    return out


def gguf_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedModelError(f"GGUF tokenizer model '{kind}' is not supported (supported: gpt2 byte-level BPE)")
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))

    pre = meta.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("llama-bpe", "llama3"):
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_REGEX), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre in ("default", "gpt2"):
        backend.pre_tokenizer = byte_level
    else:  # another split regex we do not know would tokenize differently, silently
        raise UnsupportedModelError(
            f"GGUF pre-tokenizer '{pre}' is not supported (supported: default, gpt2, smollm, llama-bpe)"
        )
    backend.decoder = decoders.ByteLevel()

    types = meta.get("tokenizer.ggml.token_type")
    if types is not None:
        types = types.tolist()
        special = [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == _CONTROL]
        user = [
            AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types) if t == _USER_DEFINED
        ]
        backend.add_special_tokens(special)
        backend.add_tokens(user)

    def token_at(key):
        idx = meta.get(key)
        return None if idx is None else tokens[int(_scalar(idx))]

    eos_ids = {int(_scalar(meta["tokenizer.ggml.eos_token_id"]))} if "tokenizer.ggml.eos_token_id" in meta else set()
    if "tokenizer.ggml.eot_token_id" in meta:
        eos_ids.add(int(_scalar(meta["tokenizer.ggml.eot_token_id"])))
    return Tokenizer(
        backend=backend,
        eos_token_ids=eos_ids,
        bos_token=token_at("tokenizer.ggml.bos_token_id"),
        eos_token=token_at("tokenizer.ggml.eos_token_id"),
        chat_template=meta.get("tokenizer.chat_template"),
        add_bos_token=bool(_scalar(meta.get("tokenizer.ggml.add_bos_token", False))),
    )


def load_gguf(path: Path) -> tuple[dict[str, Any], dict[str, mx.array], Tokenizer]:
    tensors, meta = read_gguf(path)
    config = gguf_config(meta, tensors)
    weights = gguf_weights(tensors, config)
    return config, weights, gguf_tokenizer(meta)
