"""Hugging Face model directories: config.json + safetensors (single, sharded, or MLX-quantized)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

from ..errors import CorruptModelError, InputError
from .sliced import open_tensors, read_arrays

_SPECIAL_FLOATS = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


def _special_float(obj: dict):
    """transformers writes a float JSON cannot hold as {"__float__": "Infinity"} (PreTrainedConfig's encoding)."""
    if len(obj) == 1 and obj.get("__float__") in _SPECIAL_FLOATS:
        return _SPECIAL_FLOATS[obj["__float__"]]
    return obj


def read_config(model_dir: Path, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """config.json; a multimodal one's language model config (`log` is told that only that model loads)."""
    path = model_dir / "config.json"
    if not path.is_file():
        raise InputError(f"{model_dir} is not a model directory: it has no config.json")
    try:
        config = json.loads(path.read_text(), object_hook=_special_float)
    except json.JSONDecodeError as exc:
        raise CorruptModelError(f"{path} is not valid JSON: {exc}") from exc
    # Multimodal checkpoints nest the language model's config.
    if "text_config" in config and "hidden_size" not in config:
        outer = config
        config = {**outer["text_config"], "model_type": outer["text_config"].get("model_type", outer.get("model_type"))}
        # The multimodal wrapper decides these for the whole model (e.g. it ties the LM head).
        for key in ("tie_word_embeddings", "eos_token_id"):
            if key in outer:
                config[key] = outer[key]
        if log is not None:
            towers = [name for name in ("vision", "audio") if outer.get(f"{name}_config")] or ["vision"]
            what = f"{towers[0]} tower's" if len(towers) == 1 else f"{' and '.join(towers)} towers'"
            log(
                f"{outer.get('model_type', 'multimodal')} checkpoint: loading its {config['model_type']} language "
                f"model only (the {what} weights are not loaded)"
            )
    return config


def weight_files(model_dir: Path, warn: Callable[[str], None]) -> list[Path]:
    present = sorted(model_dir.glob("*.safetensors"))
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        try:
            named = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as exc:
            raise CorruptModelError(f"{index_path} is not a valid safetensors index: {exc}") from exc
        missing = [n for n in named if not (model_dir / n).is_file()]
        if not missing:
            return [model_dir / n for n in named]
        warn(
            f"index names {len(missing)} missing shard(s) ({', '.join(missing[:3])}); loading the *.safetensors present"
        )
    if not present:
        raise CorruptModelError(f"{model_dir} has no *.safetensors weight files")
    return present


def load_hf_weights(model_dir: Path, warn: Callable[[str], None], sliced: bool = False) -> dict[str, mx.array]:
    """Lazily loaded arrays (mx.load); `sliced`: unread handles instead, for tensor parallelism, so that each
    rank reads only its slices (loading/sliced.py)."""
    read = open_tensors if sliced else read_arrays
    weights: dict[str, mx.array] = {}
    for path in weight_files(model_dir, warn):
        weights.update(read(path))
    return weights
