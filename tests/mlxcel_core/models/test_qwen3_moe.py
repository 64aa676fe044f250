"""Qwen3-MoE: parity with transformers (top-k router with and without renormalization, dense layers by
mlp_only_layers / decoder_sparse_step, sliding window), checkpoint layouts, a 4-bit copy, and the CLI on it."""

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
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from mlxcel_cli.main import main
from mlxcel_core.models import moe

CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    initializer_range=0.1,
)
VARIANTS = {
    # Real Qwen3-MoE routing (renormalized top-k); layer 1 dense; every layer slides over 16 keys.
    "renorm-dense1-window": dict(norm_topk_prob=True, mlp_only_layers=[1], use_sliding_window=True, sliding_window=16),
    # Raw softmax probabilities of the top-k; only layer 1 ((i + 1) % 2 == 0) is sparse.
    "raw-topk-step2": dict(norm_topk_prob=False, decoder_sparse_step=2),
}
SPARSE = {"renorm-dense1-window": [True, False, True], "raw-topk-step2": [False, True, False]}
# 4-bit group-64 (experts and router included) vs fp32, on a checkpoint with transformers' default init
# (0.02; logits within about +-0.7). Measured: max-abs 0.15, relative RMS 0.21.
Q4_MAX_ABS, Q4_REL_RMS = 0.3, 0.35


def save(path, variant, **overrides):
    return save_tiny_checkpoint(
        path, Qwen3MoeConfig, Qwen3MoeForCausalLM, **{**CONFIG, **VARIANTS[variant], **overrides}
    )


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def tiny_moe(request, tmp_path_factory):
    return request.param, save(tmp_path_factory.mktemp(request.param), request.param)


def test_parity_with_transformers(tiny_moe):
    assert_parity(tiny_moe[1])


def test_sparse_and_dense_layers_follow_config(tiny_moe):
    variant, path = tiny_moe
    model = load_quiet(path).model
    assert [isinstance(layer.mlp, moe.SparseMoeBlock) for layer in model.layers] == SPARSE[variant]
    block = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, moe.SparseMoeBlock))
    assert block.switch_mlp.gate_proj.weight.shape == (8, 128, 64)
    assert block.switch_mlp.down_proj.weight.shape == (8, 64, 128)


def test_hub_config_and_fused_expert_layout_load_the_same(tiny_moe, tmp_path):
    """Hub configs say num_experts (transformers 5 saves num_local_experts); transformers' in-memory layout
    fuses experts into gate_up_proj [E, 2I, H] and down_proj [E, H, I]. Both load to the same model."""
    _, src = tiny_moe
    reference = checkpoint_logits(src)
    path = shutil.copytree(src, tmp_path / "hub-fused")
    config = json.loads((path / "config.json").read_text())
    config["num_experts"] = config.pop("num_local_experts")
    (path / "config.json").write_text(json.dumps(config))
    weights = mx.load(str(path / "model.safetensors"))
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}.mlp.experts"
        if f"{prefix}.0.gate_proj.weight" not in weights:
            continue
        stacked = {
            name: mx.stack([weights.pop(f"{prefix}.{e}.{name}.weight") for e in range(8)])
            for name in ("gate_proj", "up_proj", "down_proj")
        }
        weights[f"{prefix}.gate_up_proj"] = mx.concatenate([stacked["gate_proj"], stacked["up_proj"]], axis=1)
        weights[f"{prefix}.down_proj"] = stacked["down_proj"]
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    np.testing.assert_array_equal(checkpoint_logits(path), reference)


def test_sorted_and_unsorted_expert_paths_agree(tiny_moe, monkeypatch):
    """Prefill sorts (token, expert) pairs by expert before gather_mm; decode does not. Same numbers."""
    model = load_quiet(tiny_moe[1]).model
    sorted_path = logits(model)
    monkeypatch.setattr(moe, "SORT_THRESHOLD", 1 << 30)
    np.testing.assert_allclose(logits(model), sorted_path, atol=1e-5, rtol=0)


def test_4bit_copy_is_close_to_fp32_and_generates(tmp_path):
    src = save(tmp_path / "fp32", "renorm-dense1-window", initializer_range=0.02)
    dst = quantize_4bit(src, tmp_path / "q4")
    quantized = load_quiet(dst).model
    block = quantized.layers[0].mlp
    for proj in (block.switch_mlp.gate_proj, block.switch_mlp.up_proj, block.switch_mlp.down_proj):
        assert isinstance(proj, moe.QuantizedSwitchLinear) and (proj.bits, proj.group_size) == (4, 64)
    assert isinstance(block.gate, nn.QuantizedLinear)
    assert isinstance(quantized.layers[1].mlp.down_proj, nn.QuantizedLinear)

    assert_4bit_close(src, quantized, Q4_MAX_ABS, Q4_REL_RMS)

    assert main(["generate", "-m", str(dst), "-p", "hello", "-n", "4"]) == 0
