"""load_model: resolve a spec, read config/weights/tokenizer, build the model."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from ..errors import InputError
from ..model_store import record_use
from ..paths import use_kernel_cache
from ..tokenizer import Tokenizer, load_hf_tokenizer
from .gguf import load_gguf
from .hf import load_hf_weights, read_config
from .resolve import ModelSource, resolve_model
from .weights import build_model, float32_on_cpu


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Tokenizer
    config: dict[str, Any]
    source: ModelSource


def _stderr(msg: str) -> None:
    print(f"mlxcel: {msg}", file=sys.stderr)


def _holds_nothing(directory: Path) -> bool:
    try:
        return not any(not path.name.startswith(".") for path in directory.iterdir())  # (processes' own dirs)
    except OSError:  # (an MLX_PTX_CACHE_DIR that MLX has not created yet)
        return True


def load_model(
    spec: str | None = None,
    log: Callable[[str], None] = _stderr,
    group=None,
    adapter_path: str | None = None,
    on_source: Callable[[ModelSource], None] | None = None,
) -> LoadedModel:
    """Load a model from a directory, a .gguf file, a Hub repo id, or (None) the default model.

    `on_source`: called with the model's files once they are found, before they are read (serve starts compiles
    that overlap the load there: server/warmup.py `modules_early`).

    `adapter_path`: an mlx-lm LoRA/DoRA adapter directory, fused into the weights (mlxcel_core/adapters.py).

    `group` (an mx.distributed group of size > 1): this rank's tensor-parallel shard of the model. From
    safetensors the rank reads only its slices' bytes (loading/sliced.py); from GGUF each sharded tensor is
    read whole once and sliced in memory."""
    kernels = use_kernel_cache()  # before anything compiles
    if adapter_path is not None and group is not None and group.size() > 1:
        raise InputError("--adapter-path cannot be combined with tensor parallelism (--tp-size > 1)")
    source = resolve_model(spec, log)
    if on_source is not None:
        on_source(source)
    if source.kind == "gguf":
        config, weights, tokenizer = load_gguf(source.path, log)
        # on the CPU fp32 throughout (faster there, and closer to the reference); elsewhere read_gguf's half dtype
        dtype = mx.float32 if mx.default_device() == mx.cpu else None
    else:
        config = read_config(source.path, log)
        weights = load_hf_weights(source.path, warn=log, sliced=group is not None and group.size() > 1)
        tokenizer = load_hf_tokenizer(source.path, config)
        dtype = None
    model = build_model(config, weights, dtype, group=group)
    float32_on_cpu(model)  # (not in build_model: `convert` keeps the source's dtypes)
    if adapter_path is not None:
        from ..adapters import fuse_adapters

        fuse_adapters(model, adapter_path, log)  # before the backend swaps in its kernel modules
    from .. import backends

    if kernels is not None and _holds_nothing(kernels):  # (said once the input is known good: errors stay one line)
        log(
            f"first run with this GPU and MLX version: compiling CUDA kernels (about a minute for an 8B model); "
            f"later runs reuse them from {kernels}"
        )
    backends.current().prepare_model(model)  # the backend's kernel modules, where it has any
    record_use(source.path)  # `mlxcel ls` shows when each model was last used
    return LoadedModel(model, tokenizer, config, source)
