"""Qwen3: parity with transformers (q_norm/k_norm, explicit head_dim, tied embeddings, sliding layers),
a 4-bit copy, and the CLI on it."""

from __future__ import annotations

import shutil

import mlx.nn as nn
import numpy as np
import pytest
from parity import assert_4bit_close, assert_parity, checkpoint_logits, load_quiet, quantize_4bit, save_tiny_checkpoint
from transformers import Qwen3Config, Qwen3ForCausalLM

from mlxcel_cli.main import main

# head_dim 32 != hidden / heads (16); tied LM head; layer 1 slides over 16 keys of the 64-token prompt.
CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    tie_word_embeddings=True,
    initializer_range=0.1,
    use_sliding_window=True,
    sliding_window=16,
    max_window_layers=1,
)
# 4-bit group-64 vs fp32, on a checkpoint with transformers' default init (0.02; logits within about +-1.2).
# Measured: max-abs 0.16, relative RMS 0.19. Random weights quantize worse than trained ones.
Q4_MAX_ABS, Q4_REL_RMS = 0.3, 0.35


def set_norms(path, value=None, suffixes=("norm.weight",), seed=0):
    """Rewrite RMSNorm weights (transformers initializes them to ones) to `value`, or random in [0.5, 1.5)."""
    from safetensors.numpy import load_file, save_file

    weights = load_file(path / "model.safetensors")
    rng = np.random.default_rng(seed)
    for name, w in weights.items():
        if name.endswith(suffixes):
            weights[name] = (
                np.full_like(w, value) if value is not None else rng.uniform(0.5, 1.5, w.shape).astype(w.dtype)
            )
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    path = save_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), Qwen3Config, Qwen3ForCausalLM, **CONFIG)
    return set_norms(path)  # so parity also checks that q_norm / k_norm are applied where transformers does


def test_parity_with_transformers(tiny_qwen3):
    assert_parity(tiny_qwen3)


def test_yarn_rope_parity(tmp_path):
    """Qwen2.5 / Qwen3 extend their context with YaRN (rope_scaling type yarn)."""
    rope = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32}
    path = save_tiny_checkpoint(tmp_path, Qwen3Config, Qwen3ForCausalLM, **{**CONFIG, "rope_parameters": rope})
    assert_parity(set_norms(path))


def test_architecture_follows_config(tiny_qwen3):
    model = load_quiet(tiny_qwen3).model
    attn = model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (4 * 32, 64) and attn.q_norm.weight.shape == (32,)
    assert "bias" not in attn.q_proj
    assert [layer.self_attn.window for layer in model.layers] == [None, 16]
    assert "lm_head" not in model


def test_qk_norm_matters(tiny_qwen3, tmp_path):
    """The fixture's random q/k norm weights reach the logits: unit ones give other logits."""
    reference = checkpoint_logits(tiny_qwen3)
    path = set_norms(
        shutil.copytree(tiny_qwen3, tmp_path / "unit-norms"), value=1.0, suffixes=("q_norm.weight", "k_norm.weight")
    )
    assert np.abs(checkpoint_logits(path) - reference).max() > 1e-3


def test_4bit_copy_is_close_to_fp32_and_generates(tmp_path):
    src = save_tiny_checkpoint(
        tmp_path / "fp32", Qwen3Config, Qwen3ForCausalLM, **{**CONFIG, "initializer_range": 0.02}
    )
    dst = quantize_4bit(src, tmp_path / "q4")
    quantized = load_quiet(dst).model
    attn = quantized.layers[0].self_attn
    assert isinstance(attn.q_proj, nn.QuantizedLinear) and (attn.q_proj.bits, attn.q_proj.group_size) == (4, 64)
    assert isinstance(quantized.model.embed_tokens, nn.QuantizedEmbedding)  # also the tied LM head

    assert_4bit_close(src, quantized, Q4_MAX_ABS, Q4_REL_RMS)

    assert main(["generate", "-m", str(dst), "-p", "hello", "-n", "4"]) == 0
