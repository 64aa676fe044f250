"""Mixtral: parity with transformers (top-2 of 4 experts, renormalized; sliding window), checkpoint
layouts, a 4-bit copy, and the CLI on it."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
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
from transformers import MixtralConfig, MixtralForCausalLM

from mlxcel_cli.main import main
from mlxcel_core.models import moe

# Every layer slides over 16 keys of the 64-token prompt.
CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=16,
    initializer_range=0.1,
)
# 4-bit group-64 (experts and router included) vs fp32, on a checkpoint with transformers' default init
# (0.02; logits within about +-0.6). Measured: max-abs 0.11, relative RMS 0.16.
Q4_MAX_ABS, Q4_REL_RMS = 0.3, 0.35


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("mixtral"), MixtralConfig, MixtralForCausalLM, **CONFIG)


def test_parity_with_transformers(tiny_mixtral):
    assert_parity(tiny_mixtral)


def test_sliding_window_matters(tiny_mixtral, tmp_path):
    model = load_quiet(tiny_mixtral).model
    assert [layer.self_attn.window for layer in model.layers] == [16, 16]
    path = shutil.copytree(tiny_mixtral, tmp_path / "full")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "sliding_window": None}))
    assert np.abs(checkpoint_logits(path) - logits(model)).max() > 1e-3


def test_transformers_in_memory_layout_loads_the_same(tiny_mixtral, tmp_path):
    """Checkpoints carry block_sparse_moe.experts.{i}.w1/w2/w3; transformers' in-memory model names the block
    `mlp` and fuses experts into gate_up_proj [E, 2I, H] (w1 then w3) and down_proj [E, H, I]."""
    reference = checkpoint_logits(tiny_mixtral)
    path = shutil.copytree(tiny_mixtral, tmp_path / "fused")
    weights = mx.load(str(path / "model.safetensors"))
    for i in range(CONFIG["num_hidden_layers"]):
        old, new = f"model.layers.{i}.block_sparse_moe", f"model.layers.{i}.mlp"
        w = {n: mx.stack([weights.pop(f"{old}.experts.{e}.{n}.weight") for e in range(4)]) for n in ("w1", "w2", "w3")}
        weights[f"{new}.experts.gate_up_proj"] = mx.concatenate([w["w1"], w["w3"]], axis=1)
        weights[f"{new}.experts.down_proj"] = w["w2"]
        weights[f"{new}.gate.weight"] = weights.pop(f"{old}.gate.weight")
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    np.testing.assert_array_equal(checkpoint_logits(path), reference)


def test_4bit_copy_is_close_to_fp32_and_generates(tmp_path):
    src = save_tiny_checkpoint(
        tmp_path / "fp32", MixtralConfig, MixtralForCausalLM, **{**CONFIG, "initializer_range": 0.02}
    )
    dst = quantize_4bit(src, tmp_path / "q4")
    quantized = load_quiet(dst).model
    block = quantized.layers[0].block_sparse_moe
    for proj in (block.switch_mlp.gate_proj, block.switch_mlp.up_proj, block.switch_mlp.down_proj):
        assert isinstance(proj, moe.QuantizedSwitchLinear) and (proj.bits, proj.group_size) == (4, 64)
    assert isinstance(block.gate, nn.QuantizedLinear)

    assert_4bit_close(src, quantized, Q4_MAX_ABS, Q4_REL_RMS)

    assert main(["generate", "-m", str(dst), "-p", "hello", "-n", "4"]) == 0
