"""GGUF files: tensors, config, tokenizer.

The architecture side (config from the metadata, tensor names and the converter's changes undone) lives in
gguf_arch.py and gguf_names.py, the tokenizer in gguf_vocab.py; this module reads the file and puts them together.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

from ..tokenizer import Tokenizer
from . import gguf_arch, gguf_names, gguf_vocab
from .gguf_hparams import as_scalar
from .gguf_tensors import conversion_notice, read_gguf_tensors

# Architectures whose activations outgrow float16 (Gemma's residual stream passes 65504): bfloat16 on the GPU.
BFLOAT16_ARCHITECTURES = frozenset({"gemma", "gemma2", "gemma3", "gemma3n", "gemma4"})


def gpu_dtype(meta: dict[str, Any], kinds: set[str]) -> mx.Dtype:
    """The dtype a GGUF model computes in on the GPU, from its metadata and tensor types: half precision, as MLX's
    own checkpoints do there (MLX's quantized kernels compute in the scales' dtype, and float32 norms beside them
    would keep every activation float32, at a third of the speed). bfloat16 where the file's float tensors are
    bfloat16 or the architecture needs its range, else float16; a file of F32 tensors only stays float32 (as a
    float32 safetensors checkpoint does)."""
    if kinds <= {"F32"}:
        return mx.float32
    arch = str(as_scalar(meta.get("general.architecture", "")))
    return mx.bfloat16 if "BF16" in kinds or arch in BFLOAT16_ARCHITECTURES else mx.float16


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Tensors by GGUF name (mx.array, or gguf_tensors.QuantizedTensor for quantized types) and the metadata.

    On the CPU quantization scales are fp32 (exact for every ggml type; fp32 is also the CPU's fast dtype) and float
    tensors keep their own dtype (the model then computes in fp32); elsewhere scales and float tensors alike are
    `gpu_dtype`'s."""
    if mx.default_device() == mx.cpu:
        return read_gguf_tensors(path, scale_dtype=mx.float32)
    return read_gguf_tensors(path, scale_dtype=gpu_dtype, cast_floats=True)


def gguf_config(meta: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """Our config.json-style dict from the metadata (`tensors`: the file's tensors, by GGUF name)."""
    return gguf_arch.gguf_config(meta, tensors.keys())


def gguf_weights(tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The tensors under our parameter names, with llama.cpp's q/k permutation and +1 norms undone."""
    return gguf_names.gguf_weights(tensors, config)


def gguf_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    return gguf_vocab.gguf_tokenizer(meta)


def load_gguf(path: Path, log: Callable[[str], None] | None = None) -> tuple[dict[str, Any], dict[str, Any], Tokenizer]:
    tensors, meta = read_gguf(path)
    notice = conversion_notice(tensors)
    if notice and log is not None:
        log(notice)
    config = gguf_config(meta, tensors)
    weights = gguf_weights(tensors, config)
    return config, weights, gguf_tokenizer(meta)
