"""Mistral (llama.py with a sliding window) against transformers, plus quantized copies of llama/mistral/phi3."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from parity import assert_parity, load_quiet, prompt_ids, save_tiny_checkpoint
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Phi3Config, Phi3ForCausalLM

from mlxcel_cli.main import main
from mlxcel_core.quantize import quantize_checkpoint

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)


def test_mistral_sliding_window_matches_transformers(tmp_path):
    path = save_tiny_checkpoint(tmp_path, MistralConfig, MistralForCausalLM, sliding_window=16, **TINY)
    assert_parity(path)  # 64 prompt tokens + 32 generated: far past the 16-token window


def test_the_window_matters(tmp_path):
    windowed = save_tiny_checkpoint(tmp_path / "w", MistralConfig, MistralForCausalLM, sliding_window=16, **TINY)
    full = save_tiny_checkpoint(tmp_path / "f", MistralConfig, MistralForCausalLM, sliding_window=None, **TINY)
    ids = mx.array([prompt_ids(64)])
    a = load_quiet(windowed).model(ids)
    b = load_quiet(full).model(ids)
    assert mx.abs(a - b).max().item() > 1e-2


@pytest.mark.parametrize("family", ["llama", "mistral", "phi3"])
def test_4bit_copy_generates_from_the_cli_and_stays_close(tmp_path, family):
    config_cls, model_cls, extra = {
        "llama": (LlamaConfig, LlamaForCausalLM, {}),
        "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 16}),
        "phi3": (Phi3Config, Phi3ForCausalLM, {"pad_token_id": 0}),
    }[family]
    src = save_tiny_checkpoint(tmp_path / "fp32", config_cls, model_cls, **TINY, **extra)
    dst = quantize_checkpoint(src, tmp_path / "q4", bits=4, group_size=64)
    ids = mx.array([prompt_ids(32)])
    full = np.array(load_quiet(src).model(ids))
    quant = np.array(load_quiet(dst).model(ids))
    # Random weights quantize worse than trained ones; measured max-abs 0.1-0.3 on logits of about +-3.
    assert np.abs(full - quant).max() < 0.6
    assert np.corrcoef(full.ravel(), quant.ravel())[0, 1] > 0.95
    assert main(["generate", "-m", str(dst), "-p", "hello", "-n", "4"]) == 0
