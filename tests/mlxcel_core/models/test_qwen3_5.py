"""Qwen3.5 dense and MoE text models: parity with transformers for the text checkpoints transformers 5 saves and for
the released image-text layout (text_config nested, weights under model.language_model., a vision tower beside them,
loaded with a notice), the engine's paths over the recurrent state, a quantized copy, the CLI and the server."""

from __future__ import annotations

import json

import family_checks
import numpy as np
import pytest
import transformers as tf
from parity import assert_parity, checkpoint_logits, load_unfused, save_tiny_checkpoint
from test_qwen3_next import condition

from mlxcel_core.backends.cuda.paged_attention import cuda_kernel_available

# Layers: linear, full, linear, full (full_attention_interval 2, as transformers derives layer_types from it); the
# multimodal RoPE's sections cover the 8 rotated frequency pairs (partial rotary 0.5 of head_dim 32).
COMMON = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    initializer_range=0.1,
    full_attention_interval=2,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 1e6,
        "partial_rotary_factor": 0.5,
        "mrope_section": [4, 2, 2],
        "mrope_interleaved": True,
    },
)
DENSE = dict(intermediate_size=96)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=64,
    patch_size=4,
    num_position_embeddings=16,
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_5")
    return {
        "dense": condition(
            save_tiny_checkpoint(root / "dense", tf.Qwen3_5TextConfig, tf.Qwen3_5ForCausalLM, **COMMON, **DENSE)
        ),
        "moe": condition(
            save_tiny_checkpoint(root / "moe", tf.Qwen3_5MoeTextConfig, tf.Qwen3_5MoeForCausalLM, **COMMON, **MOE)
        ),
    }


@pytest.fixture(scope="module")
def wrapper(tmp_path_factory):
    """Qwen3_5ForConditionalGeneration as transformers saves it (the released checkpoints' layout)."""
    path = tmp_path_factory.mktemp("qwen3_5-mm") / "mm"
    text = {**COMMON, **DENSE, "vocab_size": 320}
    save_tiny_checkpoint(
        path, tf.Qwen3_5Config, tf.Qwen3_5ForConditionalGeneration, text_config=text, vision_config=VISION
    )
    return condition(path)


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_parity_with_transformers(checkpoints, name):
    assert_parity(checkpoints[name])


def test_released_image_text_layout_loads_its_text_model_with_a_notice(wrapper):
    from mlxcel_core.loading import load_model

    config = json.loads((wrapper / "config.json").read_text())
    assert config["model_type"] == "qwen3_5" and "hidden_size" not in config
    said = []
    model = load_model(str(wrapper), log=said.append).model
    notice = "qwen3_5 checkpoint: loading its qwen3_5_text language model only (the vision tower's weights"
    assert any(line.startswith(notice) for line in said), said
    assert "visual" not in model.model
    assert_parity(wrapper)  # transformers on the same directory, text-only input


def test_architecture_follows_config(checkpoints):
    dense, moe = (load_unfused(checkpoints[name]).model for name in ("dense", "moe"))
    assert [layer.layer_type for layer in dense.layers] == ["linear_attention", "full_attention"] * 2
    delta = dense.layers[0].linear_attn
    assert delta.in_proj_qkv.weight.shape == (2 * 32 + 64, 64) and delta.in_proj_z.weight.shape == (64, 64)
    assert {type(layer.mlp).__name__ for layer in dense.layers} == {"GatedMLP"}
    assert {type(layer.mlp).__name__ for layer in moe.layers} == {"SharedExpertMoe"}
    assert moe.layers[0].mlp.norm_topk_prob  # Qwen3.5-MoE's router always renormalizes (no config key)


def test_shared_expert_gate_matters(checkpoints, tmp_path):
    """The shared expert's sigmoid gate reaches the logits: another gate gives other logits."""
    import shutil

    from safetensors.numpy import load_file, save_file

    path = shutil.copytree(checkpoints["moe"], tmp_path / "gate")
    weights = load_file(path / "model.safetensors")
    for name in [n for n in weights if n.endswith("shared_expert_gate.weight")]:
        weights[name] = -weights[name]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    assert np.abs(checkpoint_logits(path) - checkpoint_logits(checkpoints["moe"])).max() > 1e-3


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_engine_paths(checkpoints, name):
    family_checks.assert_engine_paths(checkpoints[name])


@pytest.mark.skipif(not cuda_kernel_available(), reason="the delta-net decode kernels need MLX's CUDA backend")
def test_paged_decode_runs_the_delta_net_kernels_with_the_plain_paths_tokens(checkpoints, monkeypatch):
    """On CUDA the engine's paged decode steps (compiled, batched rows of mixed lengths) run the delta-net kernels
    (backends/cuda/kernels/delta_net.py), and every prompt gets the plain path's greedy tokens (dense storage: the
    ops path)."""
    from mlxcel_core.backends.cuda.kernels import delta_net

    launches = []
    rule_step = delta_net.rule_step
    monkeypatch.setattr(delta_net, "rule_step", lambda *a: launches.append(1) or rule_step(*a))
    family_checks.assert_engine_paths(checkpoints["dense"])
    assert launches, "no decode step ran the delta-net kernels"


@pytest.mark.parametrize("bits", family_checks.BITS)
def test_quantized(checkpoints, tmp_path, bits):
    family_checks.assert_quantized(checkpoints["moe"], tmp_path, bits=(bits,))


def test_cli_and_server(checkpoints):
    family_checks.assert_cli_and_server(checkpoints["dense"])


def test_bench_shape_builds_scaled_down():
    """The qwen3.5-9b bench shape, scaled down (its real size is too big for this machine), builds 4-bit and runs."""
    import mlx.core as mx

    from mlxcel_core.loading import shapes

    shape = dict(shapes.SHAPES["qwen3.5-9b"])
    assert shape["num_hidden_layers"] == 32 and shape["full_attention_interval"] == 4
    small = dict(shape, hidden_size=64, intermediate_size=128, vocab_size=512, num_hidden_layers=4, head_dim=64)
    small.update(num_attention_heads=4, num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4)
    small.update(linear_key_head_dim=64, linear_value_head_dim=64)
    shapes.SHAPES["qwen3.5-9b-small"] = small
    try:
        model, _ = shapes.build_random_model("qwen3.5-9b-small", bits=4)
    finally:
        del shapes.SHAPES["qwen3.5-9b-small"]
    assert [layer.layer_type for layer in model.layers] == ["linear_attention"] * 3 + ["full_attention"]
    assert model(mx.array([[1, 2, 3]])).shape == (1, 3, 512)
