"""Qwen2: parity with transformers (q/k/v bias, sliding-window layers), a 4-bit copy, and the CLI on it."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from transformers import Qwen2Config, Qwen2ForCausalLM

from mlxcel_cli.main import main
from mlxcel_core.loading import load_model
from mlxcel_core.quantize import quantize_checkpoint
from parity import assert_parity, prompt_ids, save_tiny_checkpoint

# Window 16 < the 64-token prompt; layers 1 and 2 slide (i >= max_window_layers), layer 0 does not.
CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, initializer_range=0.1, use_sliding_window=True, sliding_window=16,
              max_window_layers=1)
PROMPT = mx.array([prompt_ids(64)])
# 4-bit group-64 vs fp32, on a checkpoint with transformers' default init (0.02; logits within about +-0.6).
# Measured: max-abs 0.13, relative RMS 0.20. Random weights quantize worse than trained ones.
Q4_MAX_ABS, Q4_REL_RMS = 0.3, 0.35


def quiet(path):
    return load_model(str(path), log=lambda m: None)


def logits(model) -> np.ndarray:
    return np.array(model(PROMPT).astype(mx.float32))[0]


def quantize_dir(src, dst):
    return quantize_checkpoint(src, dst, bits=4, group_size=64)


def dequantized_logits(src, quantized_model) -> np.ndarray:
    """The fp32 architecture run on the dequantized 4-bit weights: what the quantized kernels must compute."""
    flat = dict(tree_flatten(quantized_model.parameters()))
    weights = {}
    for name, value in flat.items():
        base = name.rsplit(".", 1)[0]
        if name.endswith((".scales", ".biases")):
            continue
        if name.endswith(".weight") and f"{base}.scales" in flat:
            layer = dict(quantized_model.named_modules())[base]
            value = mx.dequantize(value, flat[f"{base}.scales"], flat[f"{base}.biases"],
                                  group_size=layer.group_size, bits=layer.bits)
        weights[name] = value
    model = quiet(src).model
    model.load_weights(list(weights.items()), strict=True)
    return logits(model)


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("qwen2"), Qwen2Config, Qwen2ForCausalLM, **CONFIG)


def test_parity_with_transformers(tiny_qwen2):
    assert_parity(tiny_qwen2)


def test_sliding_window_layers(tiny_qwen2, tmp_path):
    config = json.loads((tiny_qwen2 / "config.json").read_text())
    assert config["layer_types"] == ["full_attention", "sliding_attention", "sliding_attention"]
    model = quiet(tiny_qwen2).model
    assert [layer.self_attn.window for layer in model.layers] == [None, 16, 16]
    reference = logits(model)

    # Older checkpoints have no layer_types: derived from use_sliding_window + max_window_layers.
    path = shutil.copytree(tiny_qwen2, tmp_path / "no-layer-types")
    (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "layer_types"}))
    np.testing.assert_array_equal(logits(quiet(path).model), reference)

    # The window matters for a 64-token prompt: full attention everywhere gives other logits.
    (path / "config.json").write_text(json.dumps({**config, "use_sliding_window": False, "layer_types": None}))
    full = quiet(path).model
    assert [layer.self_attn.window for layer in full.layers] == [None, None, None]
    assert np.abs(logits(full) - reference).max() > 1e-3


def test_4bit_copy_is_close_to_fp32_and_generates(tmp_path):
    src = save_tiny_checkpoint(tmp_path / "fp32", Qwen2Config, Qwen2ForCausalLM,
                               **{**CONFIG, "initializer_range": 0.02})
    dst = quantize_dir(src, tmp_path / "q4")
    quantized = quiet(dst).model
    attn = quantized.layers[1].self_attn
    assert isinstance(attn.q_proj, nn.QuantizedLinear) and (attn.q_proj.bits, attn.q_proj.group_size) == (4, 64)
    assert "bias" in attn.q_proj and "bias" not in attn.o_proj

    ours, fp32 = logits(quantized), logits(quiet(src).model)
    np.testing.assert_allclose(ours, dequantized_logits(src, quantized), atol=1e-4, rtol=0)
    assert np.abs(ours - fp32).max() <= Q4_MAX_ABS
    assert np.sqrt(np.mean((ours - fp32) ** 2) / np.mean(fp32**2)) <= Q4_REL_RMS

    assert main(["generate", "-m", str(dst), "-p", "hello", "-n", "4"]) == 0
