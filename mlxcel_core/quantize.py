"""Quantize a Hugging Face checkpoint into an MLX-quantized directory that `load_model` reads back.

The output is the layout mlx-lm writes: config.json with `quantization: {group_size, bits}`, one
model.safetensors holding packed weights with `.scales` / `.biases` (affine mode), and the source's
tokenizer and other non-weight files copied. Linear and embedding layers are quantized when their input
dimension (the last weight axis) is divisible by `group_size`; the rest stay in the source dtype. The
loader infers each layer's group size and bits from the packed shapes, so such mixed files load as is.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .errors import InputError
from .loading import load_model
from .loading.hf import read_config
from .models.base import is_quantizable

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
# Weight files of any format; everything else at the top of the source directory is copied.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt", ".index.json")


def quantizable(module: nn.Module, group_size: int) -> bool:
    """Unquantized layers (Linear, Embedding, MoE expert banks) whose input dimension splits into whole groups."""
    return is_quantizable(module) and module.weight.shape[-1] % group_size == 0


def quantize_model(model: nn.Module, bits: int = 4, group_size: int = 64) -> nn.Module:
    """Quantize `model` in place (affine, with biases) and return it, prepared by the backend as load_model prepares
    a quantized checkpoint. The backend's preparation of the unquantized model is undone first: fused projections
    would keep serving decode inputs with the unquantized weights, and the quantized layers need the backend's own
    preparation (on CUDA: layers MLX's quantized_matmul computes wrong are routed around)."""
    from . import backends

    backend = backends.current()
    backend.unprepare_model(model)
    nn.quantize(model, group_size=group_size, bits=bits, class_predicate=lambda _, m: quantizable(m, group_size))
    backend.prepare_model(model)
    return model


def _check_arguments(src: Path, dst: Path, bits: int, group_size: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise InputError(f"bits must be one of {', '.join(map(str, SUPPORTED_BITS))}, got {bits}")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise InputError(f"group_size must be one of {', '.join(map(str, SUPPORTED_GROUP_SIZES))}, got {group_size}")
    if not src.is_dir():
        raise InputError(f"{src} is not a model directory (quantize_checkpoint reads Hugging Face directories)")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise InputError(f"{dst} already exists and is not an empty directory")
    if dst.resolve() == src.resolve():
        raise InputError("the quantized directory must differ from the source directory")


def quantize_checkpoint(src: Path, dst: Path, bits: int = 4, group_size: int = 64) -> Path:
    """Load the HF directory `src` with our loader, quantize it and write an MLX-quantized directory `dst`."""
    src, dst = Path(src), Path(dst)
    _check_arguments(src, dst, bits, group_size)
    read_config(src)  # a clear error for a directory without (valid) config.json
    raw_config = json.loads((src / "config.json").read_text())  # written back as is, nested configs included
    if "quantization" in raw_config or "quantization_config" in raw_config:
        raise InputError(f"{src} is already quantized; quantize from the unquantized checkpoint")

    loaded = load_model(str(src))
    model = quantize_model(loaded.model, bits=bits, group_size=group_size)
    weights = dict(tree_flatten(model.parameters()))
    if not any(name.endswith(".scales") for name in weights):
        raise InputError(f"no layer of {src} has an input dimension divisible by group_size {group_size}")

    dst.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = {**raw_config, "quantization": {"group_size": group_size, "bits": bits}}
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for path in sorted(src.iterdir()):
        if path.is_file() and path.name != "config.json" and not path.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(path, dst / path.name)
    return dst
