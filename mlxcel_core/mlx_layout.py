"""Write a model directory in the layout mlx-lm writes (mlx_lm/utils.py save_model, save_config).

- model.safetensors, or model-0000i-of-0000N.safetensors shards of at most 5 GiB (a larger tensor gets a shard of
  its own), each with metadata {"format": "mlx"}, and model.safetensors.index.json (total size, total parameters
  counted at full precision, weight map sorted by name);
- config.json with sorted keys, `quantization` mirrored as `quantization_config`, `_name_or_path` and
  `vision_config` dropped;
- a tokenizer: the source's tokenizer files copied, or (a GGUF source) tokenizer.json written from the tokenizers
  object mlxcel builds from the GGUF vocabulary, with tokenizer_config.json holding the chat template.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

MAX_SHARD_BYTES = 5 << 30
# Weight files of any format and the source's index: everything else at the top of a source directory is copied.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt", ".index.json")


def total_parameters(model: nn.Module) -> int:
    """Parameters at full precision (a quantized layer counts its unpacked weight), as mlx-lm counts them."""

    def count(module: nn.Module) -> int:
        if hasattr(module, "bits"):
            bias = module.bias.size if "bias" in module else 0
            return bias + module.weight.size * 32 // module.bits
        return sum(v.size for _, v in tree_flatten(module.parameters()))

    leaves = tree_flatten(model.leaf_modules(), is_leaf=lambda m: isinstance(m, nn.Module))
    return sum(count(m) for _, m in leaves)


def make_shards(weights: dict[str, mx.array], max_bytes: int = MAX_SHARD_BYTES) -> list[dict[str, mx.array]]:
    shards: list[dict[str, mx.array]] = []
    size = 0
    for name, value in weights.items():
        if not shards or size + value.nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += value.nbytes
    return shards


def save_weights(
    model: nn.Module, dst: Path, log: Callable[[str], None], max_bytes: int = MAX_SHARD_BYTES
) -> tuple[int, int]:
    """Write `model`'s parameters as shards and the index; (bytes, parameters). The model gives its arrays up (it is
    left empty): each shard is computed (quantized, cast) when it is written and let go after, so a second copy of
    the whole model is never held."""
    weights = dict(tree_flatten(model.parameters()))
    parameters = total_parameters(model)
    model.update(tree_map(lambda _: mx.array([]), model.parameters()))
    total = sum(v.nbytes for v in weights.values())
    shards = make_shards(weights, max_bytes)
    weights.clear()
    names = "model-{:05d}-of-{:05d}.safetensors" if len(shards) > 1 else "model.safetensors"
    weight_map: dict[str, str] = {}
    for i in range(len(shards)):
        shard, shards[i] = shards[i], None
        name = names.format(i + 1, len(shards))
        log(f"writing {name} ({i + 1}/{len(shards)}, {sum(v.nbytes for v in shard.values()) / 1e6:.1f} MB)")
        mx.save_safetensors(str(dst / name), shard, metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(shard, name))
        del shard
    index = {
        "metadata": {"total_size": total, "total_parameters": parameters},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))
    return total, parameters


def save_config(config: dict[str, Any], dst: Path) -> None:
    config = dict(config)
    config.pop("_name_or_path", None)
    config.pop("vision_config", None)
    if "quantization" in config:
        config["quantization_config"] = config["quantization"]
    (dst / "config.json").write_text(json.dumps(dict(sorted(config.items())), indent=4))


def copy_tokenizer_files(src_dir: Path, dst: Path) -> list[str]:
    """The source directory's non-weight files (tokenizer, generation config, chat template, license)."""
    copied = []
    for path in sorted(src_dir.iterdir()):
        if path.is_file() and path.name != "config.json" and not path.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(path, dst / path.name)
            copied.append(path.name)
    return copied


def write_tokenizer(tokenizer, dst: Path, context_length: int | None) -> None:
    """tokenizer.json and tokenizer_config.json from mlxcel's Tokenizer (a GGUF's vocabulary): the tokenizers
    object as it is (its post-processor adds BOS where the GGUF asks), the chat template, BOS and EOS."""
    tokenizer.backend.save(str(dst / "tokenizer.json"))
    tok_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "add_bos_token": tokenizer.add_bos_token,
        "clean_up_tokenization_spaces": False,
    }
    if context_length:
        tok_config["model_max_length"] = context_length
    if tokenizer.chat_template is not None:
        tok_config["chat_template"] = tokenizer.chat_template
    (dst / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False))
