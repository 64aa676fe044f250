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
from .gguf_tensors import conversion_notice, read_gguf_tensors


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Tensors by GGUF name (mx.array, or gguf_tensors.QuantizedTensor for quantized types) and the metadata.

    Quantization scales are fp32 on the CPU (exact for every ggml type) and fp16 elsewhere, as in MLX's own
    quantized checkpoints (bf16 for a file whose float tensors are bf16)."""
    return read_gguf_tensors(path, scale_dtype=mx.float32 if mx.default_device() == mx.cpu else None)


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
