"""GLM-4.5 / GLM-4.5-Air (glm4_moe): parity with transformers, from transformers 5's config and from the Hub's older
style, on two variants: GLM-4.5-like (q/k norms, 2 expert groups of which the router keeps 1, routed scaling 2.5,
renormalized weights, MTP layer tensors in the checkpoint) and Air-like (no q/k norms, one group, raw sigmoid
weights, two dense layers, two shared experts, a quarter of each head rotated, tied embeddings). Both with attention
biases and random norms, biases and expert-score correction biases; the correction bias and the group limit are
shown to change which experts are chosen. Refusals, engine paths, quantized copies, CLI and server."""

from __future__ import annotations

import json
import shutil

import family_checks
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from parity import (
    assert_parity,
    checkpoint_logits,
    load_quiet,
    load_unfused,
    logits,
    randomize_norms_and_biases,
    save_tiny_checkpoint,
)
from tiny_configs import GLM4_MOE, GLM4_MOE_VARIANTS
from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

from mlxcel_core.errors import UnsupportedModelError
from mlxcel_core.models import glm4_moe
from mlxcel_core.models.grouped_moe import GroupedMoeBlock, GroupedTopKRouter
from mlxcel_core.models.moe import QuantizedSwitchLinear
from mlxcel_core.models.transformer import GatedMLP

VARIANTS = GLM4_MOE_VARIANTS
ROTARY_DIMS = {"glm-4.5": 16, "air": 8}
MTP_LAYER = GLM4_MOE["num_hidden_layers"]  # the multi-token-prediction layer's index in released checkpoints


def randomize(path, seed=0, mtp=False):
    """Random norms, biases and correction biases; `mtp`: with a multi-token-prediction layer as layer MTP_LAYER."""
    return randomize_norms_and_biases(path, seed, MTP_LAYER if mtp else None)


def save(path, variant, **overrides):
    path = save_tiny_checkpoint(
        path, Glm4MoeConfig, Glm4MoeForCausalLM, **{**GLM4_MOE, **VARIANTS[variant], **overrides}
    )
    return randomize(path, mtp=variant == "glm-4.5")


def rewrite_config_older_style(path, keep_partial_rotary=True):
    """config.json as the Hub's GLM-4.5 checkpoints (transformers 4) write it: top-level rope_theta and
    partial_rotary_factor, rope_scaling null. Without `keep_partial_rotary` the factor is left out (Glm4MoeConfig's
    default 0.5 applies)."""
    config = json.loads((path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope["rope_theta"]
    if keep_partial_rotary:
        config["partial_rotary_factor"] = rope["partial_rotary_factor"]
    config["rope_scaling"] = None
    config["torch_dtype"] = config.pop("dtype", "float32")
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def tiny_glm(request, tmp_path_factory):
    return request.param, save(tmp_path_factory.mktemp(request.param), request.param)


def test_parity_with_transformers(tiny_glm):
    assert_parity(tiny_glm[1])


def test_older_config_style_parity(tiny_glm, tmp_path):
    """The Hub's configs: top-level rope_theta / partial_rotary_factor (GLM-4.5's variant leaves the factor out:
    the default 0.5 is its value). Same logits as transformers 5's config, and parity."""
    variant, src = tiny_glm
    path = rewrite_config_older_style(shutil.copytree(src, tmp_path / "older"), keep_partial_rotary=variant == "air")
    np.testing.assert_array_equal(checkpoint_logits(path), checkpoint_logits(src))
    assert_parity(path)


def test_architecture_follows_config(tiny_glm):
    variant, path = tiny_glm
    spec = VARIANTS[variant]
    model = load_unfused(path).model
    attn = model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (4 * 32, 64) and "bias" in attn.q_proj and "bias" not in attn.o_proj
    assert attn.rope.dims == ROTARY_DIMS[variant] and attn.window is None
    assert attn.qk_norm == spec["use_qk_norm"]
    dense = spec["first_k_dense_replace"]
    assert [type(layer.mlp) for layer in model.layers] == [GatedMLP] * dense + [GroupedMoeBlock] * (3 - dense)
    block = model.layers[-1].mlp
    assert block.switch_mlp.gate_proj.weight.shape == (8, 64, 64)
    assert block.shared_experts.gate_proj.weight.shape == (64 * spec["n_shared_experts"], 64)
    assert (block.gate.n_group, block.gate.topk_group, block.gate.top_k) == (
        spec["n_group"],
        spec["topk_group"],
        spec["num_experts_per_tok"],
    )
    assert len(model.layers) == 3  # the MTP layer (glm-4.5's checkpoint) is not built


def test_checkpoint_carries_mtp_layer_that_is_dropped(tiny_glm):
    variant, path = tiny_glm
    if variant != "glm-4.5":
        pytest.skip("only the GLM-4.5 variant's checkpoint carries an MTP layer")
    names = mx.load(str(path / "model.safetensors")).keys()
    assert f"model.layers.{MTP_LAYER}.eh_proj.weight" in names
    assert f"model.layers.{MTP_LAYER}.mlp.experts.0.gate_proj.weight" in names
    model = load_quiet(path).model  # (strict loading: no tensor left over)
    weights = model.sanitize(dict(mx.load(str(path / "model.safetensors"))))
    assert not any(name.startswith(f"model.layers.{MTP_LAYER}.") for name in weights)


def router_inputs(model, monkeypatch) -> list[mx.array]:
    """The inputs of each MoE layer's router over the test prompt."""
    seen = []
    call = GroupedTopKRouter.__call__
    monkeypatch.setattr(GroupedTopKRouter, "__call__", lambda self, x: seen.append(x) or call(self, x))
    logits(model)
    monkeypatch.undo()
    return seen


def chosen(router, x) -> np.ndarray:
    return np.sort(np.array(router(x)[0]), axis=-1).reshape(-1, router.top_k)


def test_correction_bias_and_group_limit_change_the_choice(tiny_glm, monkeypatch):
    """Over the prompt's real router inputs, the random correction bias changes the chosen experts of many tokens
    (parity shows transformers chooses as we do); GLM-4.5's variant takes all of a token's experts from one group
    of 4, and without the group limit some tokens would choose others."""
    variant, path = tiny_glm
    model = load_quiet(path).model
    sparse = [layer.mlp for layer in model.layers if isinstance(layer.mlp, GroupedMoeBlock)]
    for block, x in zip(sparse, router_inputs(model, monkeypatch), strict=True):
        router = block.gate
        biased = chosen(router, x)
        bias = router.e_score_correction_bias
        router.e_score_correction_bias = mx.zeros_like(bias)
        unbiased = chosen(router, x)
        router.e_score_correction_bias = bias
        assert (biased != unbiased).any(axis=-1).mean() > 0.2
        if variant == "glm-4.5":
            assert (biased // 4 == biased[:, :1] // 4).all()
            router.topk_group = router.n_group
            ungrouped = chosen(router, x)
            router.topk_group = 1
            assert (biased != ungrouped).any()


def test_router_weights_follow_transformers_formula():
    """Renormalized (+1e-20) unbiased sigmoid scores of the chosen experts, times routed_scaling_factor."""
    router = GroupedTopKRouter(8, 8, top_k=2, n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5)
    router.weight = mx.random.normal((8, 8), key=mx.random.key(1))
    router.e_score_correction_bias = mx.random.uniform(-0.3, 0.3, (8,), key=mx.random.key(2))
    x = mx.random.normal((5, 8), key=mx.random.key(3))
    indices, weights = router(x)
    scores = np.array(mx.sigmoid(x @ router.weight.T))
    picked = np.take_along_axis(scores, np.array(indices), axis=-1)
    np.testing.assert_allclose(np.array(weights), 2.5 * picked / picked.sum(-1, keepdims=True), rtol=1e-6)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(n_group=3), "n_group 3 does not divide the 8 routed experts"),
        (dict(n_group=8, topk_group=1), "at least 2 experts per group"),
        (dict(n_group=2, topk_group=3), "topk_group 3 is not between 1 and n_group 2"),
        (dict(n_group=2, topk_group=1, num_experts_per_tok=5), "num_experts_per_tok 5 is more than the 4 experts"),
        (dict(mlp_layer_types=["dense", "dense", "sparse"]), "mlp_layer_types that differ from first_k_dense_replace"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
        (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), "rope scaling type 'dynamic' is not supported"),
    ],
)
def test_refuses_what_it_cannot_compute(overrides, message):
    config = {**GLM4_MOE, "vocab_size": 320, "model_type": "glm4_moe", **overrides}
    with pytest.raises(UnsupportedModelError, match=message):
        glm4_moe.Model(glm4_moe.ModelArgs.from_dict(config))


def test_engine_paths(tiny_glm):
    family_checks.assert_engine_paths(tiny_glm[1])


@pytest.mark.parametrize("bits", family_checks.BITS)
def test_quantized(tiny_glm, tmp_path, bits):
    """The 4- or 8-bit copy: expert banks and dense layers quantized, the router left as it is (mlx-lm's layout)."""
    family_checks.assert_quantized(tiny_glm[1], tmp_path, bits=(bits,))
    model = load_quiet(tmp_path / f"q{bits}").model
    block = model.layers[-1].mlp
    assert isinstance(block.switch_mlp.down_proj, QuantizedSwitchLinear) and block.switch_mlp.down_proj.bits == bits
    assert isinstance(block.shared_experts.up_proj, nn.QuantizedLinear)
    assert type(block.gate) is GroupedTopKRouter and block.gate.weight.dtype == mx.float32


def test_cli_and_server(tiny_glm):
    family_checks.assert_cli_and_server(tiny_glm[1])
