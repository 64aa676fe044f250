"""Mixtral: parity with transformers (top-2 of 4 experts, renormalized; sliding window), checkpoint
layouts, a 4-bit copy, and the CLI on it."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from transformers import MixtralConfig, MixtralForCausalLM

from mlxcel_cli.main import main
from mlxcel_core import quantize
from mlxcel_core.loading import load_model
from mlxcel_core.models import moe
from parity import assert_parity, prompt_ids, save_tiny_checkpoint

# Every layer slides over 16 keys of the 64-token prompt.
CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
              initializer_range=0.1)
PROMPT = mx.array([prompt_ids(64)])
# 4-bit group-64 (experts and router included) vs fp32, on a checkpoint with transformers' default init
# (0.02; logits within about +-0.6). Measured: max-abs 0.11, relative RMS 0.16.
Q4_MAX_ABS, Q4_REL_RMS = 0.3, 0.35


def quiet(path):
    return load_model(str(path), log=lambda m: None)


def logits(model) -> np.ndarray:
    return np.array(model(PROMPT).astype(mx.float32))[0]


def quantize_dir(src, dst, monkeypatch):
    """The project's quantize_checkpoint (4-bit, group 64); expert banks included."""
    return quantize.quantize_checkpoint(src, dst, bits=4, group_size=64)


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
def tiny_mixtral(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("mixtral"), MixtralConfig, MixtralForCausalLM, **CONFIG)


def test_parity_with_transformers(tiny_mixtral):
    assert_parity(tiny_mixtral)


def test_sliding_window_matters(tiny_mixtral, tmp_path):
    model = quiet(tiny_mixtral).model
    assert [layer.self_attn.window for layer in model.layers] == [16, 16]
    path = shutil.copytree(tiny_mixtral, tmp_path / "full")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "sliding_window": None}))
    assert np.abs(logits(quiet(path).model) - logits(model)).max() > 1e-3


def test_transformers_in_memory_layout_loads_the_same(tiny_mixtral, tmp_path):
    """Checkpoints carry block_sparse_moe.experts.{i}.w1/w2/w3; transformers' in-memory model names the block
    `mlp` and fuses experts into gate_up_proj [E, 2I, H] (w1 then w3) and down_proj [E, H, I]."""
    reference = logits(quiet(tiny_mixtral).model)
    path = shutil.copytree(tiny_mixtral, tmp_path / "fused")
    weights = mx.load(str(path / "model.safetensors"))
    for i in range(CONFIG["num_hidden_layers"]):
        old, new = f"model.layers.{i}.block_sparse_moe", f"model.layers.{i}.mlp"
        w = {n: mx.stack([weights.pop(f"{old}.experts.{e}.{n}.weight") for e in range(4)]) for n in ("w1", "w2", "w3")}
        weights[f"{new}.experts.gate_up_proj"] = mx.concatenate([w["w1"], w["w3"]], axis=1)
        weights[f"{new}.experts.down_proj"] = w["w2"]
        weights[f"{new}.gate.weight"] = weights.pop(f"{old}.gate.weight")
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    np.testing.assert_array_equal(logits(quiet(path).model), reference)


def test_4bit_copy_is_close_to_fp32_and_generates(tmp_path, monkeypatch):
    src = save_tiny_checkpoint(tmp_path / "fp32", MixtralConfig, MixtralForCausalLM,
                               **{**CONFIG, "initializer_range": 0.02})
    dst = quantize_dir(src, tmp_path / "q4", monkeypatch)
    quantized = quiet(dst).model
    block = quantized.layers[0].block_sparse_moe
    for proj in (block.switch_mlp.gate_proj, block.switch_mlp.up_proj, block.switch_mlp.down_proj):
        assert isinstance(proj, moe.QuantizedSwitchLinear) and (proj.bits, proj.group_size) == (4, 64)
    assert isinstance(block.gate, nn.QuantizedLinear)

    ours, fp32 = logits(quantized), logits(quiet(src).model)
    np.testing.assert_allclose(ours, dequantized_logits(src, quantized), atol=1e-4, rtol=0)
    assert np.abs(ours - fp32).max() <= Q4_MAX_ABS
    assert np.sqrt(np.mean((ours - fp32) ** 2) / np.mean(fp32**2)) <= Q4_REL_RMS

    assert main(["generate", "-m", str(dst), "-p", "hello", "-n", "4"]) == 0
