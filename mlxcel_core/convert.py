"""`mlxcel convert`: a Hugging Face checkpoint (directory or Hub repo) or a GGUF file -> an MLX directory.

The output is what `mlx_lm.convert` writes (mlx_layout.py), so it loads in mlxcel and in mlx-lm. Optionally
quantized (convert_recipes.py: uniform bits or a mixed recipe), dequantized, or cast to another dtype. The model is
built once (one copy in memory); quantization and casts stay lazy until each shard is written. The directory is
written under a temporary name beside OUT and renamed when complete, so a failed conversion leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

from .convert_recipes import RECIPES, SUPPORTED_BITS, SUPPORTED_GROUP_SIZES, quantization_entry, quantize_layers
from .dequantize import dequantize_model, is_quantized
from .errors import InputError
from .loading.resolve import ModelSource, resolve_model

DTYPES = ("float16", "bfloat16", "float32")
Log = Callable[[str], None]


@dataclass(frozen=True)
class ConvertOptions:
    quantize: bool = False
    bits: int = 4
    group_size: int = 64
    recipe: str | None = None
    dequantize: bool = False
    dtype: str | None = None
    force: bool = False


@dataclass(frozen=True)
class ConvertResult:
    path: Path
    source: str  # the source's files: its directory or GGUF file (a path, for scripts; the log line says more)
    quantization: dict | None
    size_bytes: int
    parameters: int


def check_options(options: ConvertOptions) -> None:
    if options.quantize and options.dequantize:
        raise InputError("choose -q/--quantize or --dequantize, not both")
    if options.recipe is not None and not options.quantize:
        raise InputError("--q-recipe needs -q/--quantize")
    if options.bits not in SUPPORTED_BITS:
        raise InputError(f"--q-bits must be one of {', '.join(map(str, SUPPORTED_BITS))}, got {options.bits}")
    if options.group_size not in SUPPORTED_GROUP_SIZES:
        sizes = ", ".join(map(str, SUPPORTED_GROUP_SIZES))
        raise InputError(f"--q-group-size must be one of {sizes}, got {options.group_size}")
    if options.recipe is not None and options.recipe not in RECIPES:
        raise InputError(f"--q-recipe must be one of {', '.join(RECIPES)}, got '{options.recipe}'")
    if options.dtype is not None and options.dtype not in DTYPES:
        raise InputError(f"--dtype must be one of {', '.join(DTYPES)}, got '{options.dtype}'")


def _check_output(out: Path, force: bool, source: Path | None = None) -> None:
    """OUT must not exist, unless --force and it is a file or a model directory (never the source or above it)."""
    if not out.exists() and not out.is_symlink():
        return
    if not force:
        raise InputError(f"{out} already exists (pass --force to replace it)")
    if source is not None and (out.resolve() == source.resolve() or out.resolve() in source.resolve().parents):
        raise InputError(f"{out} holds the source model; write the conversion elsewhere")
    if out.is_dir() and any(out.iterdir()) and not (out / "config.json").is_file():
        raise InputError(f"{out} is a directory that is not a model directory; not replacing it")


def _source_model(source: ModelSource, log: Log) -> tuple[nn.Module, dict[str, Any], Any]:
    """(model, config to write, tokenizer or None where the source's files are copied)."""
    from .loading.weights import build_model

    if source.kind == "gguf":
        from .loading.gguf import gguf_config, gguf_tokenizer, gguf_weights
        from .loading.gguf_tensors import conversion_notice, read_gguf_tensors

        tensors, meta = read_gguf_tensors(source.path, scale_dtype=mx.float32)  # fp32 scales: every ggml type exact
        if notice := conversion_notice(tensors):
            log(notice)
        config = gguf_config(meta, tensors)
        weights = gguf_weights(tensors, config)
        del tensors
        return build_model(config, weights), config, gguf_tokenizer(meta)
    from .loading.hf import load_hf_weights, read_config

    config = read_config(source.path, log)
    raw = json.loads((source.path / "config.json").read_text())
    written = raw if "text_config" not in raw or "hidden_size" in raw else config
    model = build_model(config, load_hf_weights(source.path, warn=log))
    return model, written, None


def config_dtype(config: dict[str, Any]) -> str | None:
    """The dtype config.json names (torch_dtype or dtype, at the top or in text_config), where it is one of DTYPES."""
    for holder in (config, config.get("text_config") or {}):
        for key in ("torch_dtype", "dtype"):
            if holder.get(key) in DTYPES:
                return holder[key]
    return None


def _cast(model: nn.Module, dtype: str) -> None:
    target = getattr(mx, dtype)
    model.update(tree_map(lambda v: v.astype(target) if mx.issubdtype(v.dtype, mx.floating) else v, model.parameters()))


def _check_source(model: nn.Module, options: ConvertOptions) -> None:
    quantized = any(is_quantized(m) for _, m in model.named_modules())
    if options.quantize and quantized:
        raise InputError("the source is already quantized: quantize the original, or --dequantize this one first")
    if options.dequantize and not quantized:
        raise InputError("--dequantize: the source is not quantized")


def _transform(model: nn.Module, config: dict[str, Any], options: ConvertOptions, log: Log) -> dict | None:
    """Cast, quantize or dequantize `model` in place; the `quantization` entry of the written config."""
    dtype = options.dtype or config_dtype(config)
    if dtype is not None:
        log(f"dtype: {dtype}")
        _cast(model, dtype)
    if options.dequantize:
        log(f"dequantizing {dequantize_model(model)} layers")
    if options.quantize:
        count = quantize_layers(model, options.bits, options.group_size, options.recipe)
        if count == 0:
            raise InputError(f"no layer's input dimension is divisible by --q-group-size {options.group_size}")
        what = options.recipe or f"{options.bits}-bit"
        log(f"quantizing {count} layers ({what}, group size {options.group_size})")
    return quantization_entry(model)


def convert(spec: str, out: Path | str, options: ConvertOptions = ConvertOptions(), log: Log = lambda _: None):
    """Convert the model `spec` (a directory, a .gguf file, a Hub repo id or catalogue name) into `out`."""
    from .mlx_layout import copy_tokenizer_files, save_config, save_weights, write_tokenizer

    check_options(options)
    out = Path(out).expanduser()
    _check_output(out, options.force)
    source = resolve_model(spec, log)
    _check_output(out, options.force, source.path)
    model, config, tokenizer = _source_model(source, log)
    _check_source(model, options)
    log(f"converting {source.origin}")
    quantization = _transform(model, config, options, log)
    config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    if quantization is not None:
        config["quantization"] = quantization
    if options.dtype is not None:
        config["torch_dtype"] = options.dtype
    if tokenizer is not None and tokenizer.eos_token_ids and "eos_token_id" not in config:
        eos = sorted(tokenizer.eos_token_ids)
        config["eos_token_id"] = eos[0] if len(eos) == 1 else eos

    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        size, parameters = save_weights(model, partial, log)
        del model
        save_config(config, partial)
        if tokenizer is None:
            copy_tokenizer_files(source.path, partial)
        else:
            write_tokenizer(tokenizer, partial, config.get("max_position_embeddings"))
        _replace(out, partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return ConvertResult(out, str(source.path), quantization, size, parameters)


def _replace(out: Path, partial: Path) -> None:
    if out.is_dir() and not out.is_symlink():
        shutil.rmtree(out)
    elif out.exists() or out.is_symlink():
        out.unlink()
    partial.rename(out)
