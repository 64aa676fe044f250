"""Qwen2: parity with transformers (q/k/v bias, sliding-window layers), a 4-bit copy, and the CLI on it."""

from __future__ import annotations

import json
import shutil

import mlx.nn as nn
import numpy as np
import pytest
from parity import (
    assert_4bit_close,
    assert_parity,
    checkpoint_logits,
    load_quiet,
    logits,
    quantize_4bit,
    save_tiny_checkpoint,
)
from transformers import Qwen2Config, Qwen2ForCausalLM

from mlxcel_cli.main import main

# Window 16 < the 64-token prompt; layers 1 and 2 slide (i >= max_window_layers), layer 0 does not.
CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.1,
    use_sliding_window=True,
    sliding_window=16,
    max_window_layers=1,
)
# 4-bit group-64 vs fp32, on a checkpoint with transformers' default init (0.02; logits within about +-0.6).
# Measured: max-abs 0.13, relative RMS 0.20. Random weights quantize worse than trained ones.
Q4_MAX_ABS, Q4_REL_RMS = 0.3, 0.35


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("qwen2"), Qwen2Config, Qwen2ForCausalLM, **CONFIG)


def test_parity_with_transformers(tiny_qwen2):
    assert_parity(tiny_qwen2)


def test_sliding_window_layers(tiny_qwen2, tmp_path):
    config = json.loads((tiny_qwen2 / "config.json").read_text())
    assert config["layer_types"] == ["full_attention", "sliding_attention", "sliding_attention"]
    model = load_quiet(tiny_qwen2).model
    assert [layer.self_attn.window for layer in model.layers] == [None, 16, 16]
    reference = logits(model)

    # Older checkpoints have no layer_types: derived from use_sliding_window + max_window_layers.
    path = shutil.copytree(tiny_qwen2, tmp_path / "no-layer-types")
    (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "layer_types"}))
    np.testing.assert_array_equal(checkpoint_logits(path), reference)

    # The window matters for a 64-token prompt: full attention everywhere gives other logits.
    (path / "config.json").write_text(json.dumps({**config, "use_sliding_window": False, "layer_types": None}))
    full = load_quiet(path).model
    assert [layer.self_attn.window for layer in full.layers] == [None, None, None]
    assert np.abs(logits(full) - reference).max() > 1e-3


def test_4bit_copy_is_close_to_fp32_and_generates(tmp_path):
    src = save_tiny_checkpoint(
        tmp_path / "fp32", Qwen2Config, Qwen2ForCausalLM, **{**CONFIG, "initializer_range": 0.02}
    )
    dst = quantize_4bit(src, tmp_path / "q4")
    quantized = load_quiet(dst).model
    attn = quantized.layers[1].self_attn
    assert isinstance(attn.q_proj, nn.QuantizedLinear) and (attn.q_proj.bits, attn.q_proj.group_size) == (4, 64)
    assert "bias" in attn.q_proj and "bias" not in attn.o_proj

    assert_4bit_close(src, quantized, Q4_MAX_ABS, Q4_REL_RMS)

    assert main(["generate", "-m", str(dst), "-p", "hello", "-n", "4"]) == 0
