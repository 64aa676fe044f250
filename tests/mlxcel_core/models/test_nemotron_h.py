"""Nemotron-H: parity with transformers (Mamba2 blocks with their recurrent state, NoPE attention, relu^2 MLP, grouped
sigmoid-routed MoE with a latent space and a shared expert) in both config styles, the engine's paths over the state
(batched, paged, chunked prefill, prompts prefilled together, a cancelled row), quantized copies, the CLI and the
server, and what is refused."""

from __future__ import annotations

import json
import shutil

import family_checks
import numpy as np
import pytest
import recurrent_checks
from parity import assert_parity, checkpoint_logits, load_quiet, prompt_ids, save_tiny_checkpoint
from transformers import NemotronHConfig, NemotronHForCausalLM

from mlxcel_core.errors import UnsupportedModelError
from mlxcel_core.models.base import has_recurrent_layers

BLOCKS = ["linear_attention", "moe", "full_attention", "linear_attention", "mlp"]
# 8 Mamba heads of 8 in 2 groups with a 16-wide state; 16-position scan chunks, which the 64-token parity prompt
# crosses; time_step_limit from 0.02, so that prompt tokens clamp some steps (and decode steps do not). MoE: 4
# experts in 2 groups (1 kept), top 2, scaled by 2.5, in a 32-wide latent space.
CONFIG = dict(
    hidden_size=64,
    intermediate_size=96,
    layers_block_type=BLOCKS,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    mamba_num_heads=8,
    mamba_head_dim=8,
    n_groups=2,
    ssm_state_size=16,
    conv_kernel=4,
    chunk_size=16,
    time_step_limit=(0.02, float("inf")),
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=48,
    moe_latent_size=32,
    tie_word_embeddings=False,
    initializer_range=0.1,
)


def condition(path, seed: int = 0):
    """Random parameters where transformers initializes constants: norms in [0.5, 1.5), D in [0.5, 1.5), decays
    A = exp(A_log) in [0.5, 4), the routers' correction biases in [-0.1, 0.1)."""
    from safetensors.numpy import load_file, save_file

    weights = load_file(path / "model.safetensors")
    rng = np.random.default_rng(seed)
    for name, w in weights.items():
        if name.endswith(("norm.weight", "norm_f.weight", ".D")):
            weights[name] = rng.uniform(0.5, 1.5, w.shape).astype(w.dtype)
        elif name.endswith("A_log"):
            weights[name] = np.log(rng.uniform(0.5, 4.0, w.shape)).astype(w.dtype)
        elif name.endswith("e_score_correction_bias"):
            weights[name] = rng.uniform(-0.1, 0.1, w.shape).astype(w.dtype)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def older_style(src, dst):
    """The released checkpoints' config.json: the `hybrid_override_pattern` string and num_hidden_layers instead of
    layers_block_type, the `mamba_*` names of the Mamba2 keys."""
    path = shutil.copytree(src, dst)
    config = json.loads((path / "config.json").read_text())
    assert config.pop("layers_block_type") == BLOCKS
    config.update(hybrid_override_pattern="ME*M-", num_hidden_layers=len(BLOCKS))
    for old, new in (
        ("mamba_n_groups", "n_groups"),
        ("mamba_d_conv", "conv_kernel"),
        ("mamba_chunk_size", "chunk_size"),
    ):
        config[old] = config.pop(new)
    config["mamba_dt_limit"] = config.pop("time_step_limit")
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_tiny_checkpoint(tmp_path_factory.mktemp("nemotron_h"), NemotronHConfig, NemotronHForCausalLM, **CONFIG)
    return condition(path)


def test_parity_with_transformers(tiny):
    assert_parity(tiny)


def test_parity_older_config_style(tiny, tmp_path):
    assert_parity(older_style(tiny, tmp_path / "older"))


def test_architecture_follows_config(tiny):
    import mlx.core as mx

    model = load_quiet(tiny).model
    assert [layer.block_type for layer in model.layers] == BLOCKS
    assert has_recurrent_layers(model)
    assert model.kv_layout() == [None, None, (2, 16), None, None]
    conv, scan = model.state_layout()[0]
    assert conv[0] == (3, 64 + 2 * 2 * 16) and scan == ((8, 8, 16), mx.float32)
    moe = model.layers[1].mixer
    assert moe.switch_mlp.fc1.weight.shape == (4, 32, 32) and moe.fc1_latent_proj.weight.shape == (32, 64)
    assert moe.gate.n_group == 2 and moe.gate.topk_group == 1 and moe.gate.routed_scaling_factor == 2.5


def test_time_step_limit_clamps_prompt_tokens_and_time_step_min_does_not(tiny, tmp_path):
    """The prompt's forward clamps dt to time_step_limit: no floor gives other logits, a ceiling gives transformers'
    (the clamp's upper side); time_step_min (dt_bias's initialization range in training) changes nothing."""

    def variant(name: str, **changes):
        path = shutil.copytree(tiny, tmp_path / name)
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, **changes}))
        return path

    unclamped = checkpoint_logits(variant("open", time_step_limit=[0.0, float("inf")]))
    assert np.abs(unclamped - checkpoint_logits(tiny)).max() > 1e-3
    assert np.array_equal(checkpoint_logits(variant("min", time_step_min=0.3)), checkpoint_logits(tiny))
    assert_parity(variant("ceiling", time_step_limit=[0.0, 0.05]), steps=8)


def test_decode_steps_do_not_clamp(tiny, tmp_path):
    """A decode step (one token after the prompt's state) takes dt unclamped, as transformers' selective state
    update: with time_step_limit from 0.5 (most steps below it) its logits are transformers' second forward's."""
    import inspect

    import mlx.core as mx
    import torch

    from mlxcel_core.cache import make_cache

    if "cache" not in inspect.signature(NemotronHForCausalLM.forward).parameters:
        pytest.skip("this transformers' NemotronH forward takes no `cache` (a second forward would start afresh)")
    path = shutil.copytree(tiny, tmp_path / "floor")
    config = json.loads((path / "config.json").read_text())
    config["time_step_limit"] = [0.5, float("inf")]
    (path / "config.json").write_text(json.dumps(config))
    prompt, token = prompt_ids(20, seed=4), 17
    reference = NemotronHForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        first = reference(torch.tensor([prompt]), use_cache=True)
        want = reference(torch.tensor([[token]]), cache=first.cache, use_cache=True).logits[0, -1].numpy()
    model = load_quiet(path).model
    cache = make_cache(len(model.layers))
    model(mx.array([prompt]), cache)
    got = np.array(model(mx.array([[token]]), cache)[0, -1])
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_mlx_lm_layout_same_logits(tiny, tmp_path):
    """mlx-lm's conversion (`backbone.` names, experts stacked as switch_mlp.fc1 / fc2, conv1d weights in MLX's
    [C, K, 1] layout) loads to the same logits."""
    import mlx.core as mx

    path = shutil.copytree(tiny, tmp_path / "mlx-lm")
    weights = load_quiet(tiny).model.parameters()
    from mlx.utils import tree_flatten

    flat = dict(tree_flatten(weights))
    out = {}
    for name, value in flat.items():
        if name.endswith("conv1d.weight"):
            value = mx.moveaxis(value, 2, 1)
        out[name.replace("model.", "backbone.", 1) if name.startswith("model.") else name] = value
    mx.save_safetensors(str(path / "model.safetensors"), out)
    np.testing.assert_allclose(checkpoint_logits(path), checkpoint_logits(tiny), atol=1e-5, rtol=0)


def test_stacked_expert_layout_same_logits(tiny, tmp_path):
    """transformers' in-memory layout (`model.` names, each MoE block's experts as one `experts.up_proj` [E, I, in]
    and `experts.down_proj`) loads to the same logits."""
    import mlx.core as mx

    path = shutil.copytree(tiny, tmp_path / "stacked")
    weights = {k.replace("backbone.", "model.", 1): v for k, v in mx.load(str(path / "model.safetensors")).items()}
    for name in ("up_proj", "down_proj"):
        prefix = "model.layers.1.mixer.experts"
        weights[f"{prefix}.{name}"] = mx.stack([weights.pop(f"{prefix}.{e}.{name}.weight") for e in range(4)])
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    np.testing.assert_allclose(checkpoint_logits(path), checkpoint_logits(tiny), atol=1e-5, rtol=0)


def test_unsupported_config_is_refused():
    from mlxcel_core.models.nemotron_h import ModelArgs

    base = {**CONFIG, "vocab_size": 320}
    with pytest.raises(UnsupportedModelError, match="mlp_hidden_act 'gelu'"):
        ModelArgs.from_dict({**base, "mlp_hidden_act": "gelu"})
    with pytest.raises(UnsupportedModelError, match="hybrid_override_pattern blocks \\['X'\\]"):
        ModelArgs.from_dict({**base, "layers_block_type": None, "hybrid_override_pattern": "M*X"})


def test_engine_paths(tiny):
    family_checks.assert_engine_paths(tiny)


def test_recurrent_state_paths(tiny):
    recurrent_checks.assert_state_paths(tiny, "nemotron_h")


@pytest.mark.parametrize("bits", family_checks.BITS)
def test_quantized(tiny, tmp_path, bits):
    family_checks.assert_quantized(tiny, tmp_path, bits=(bits,))


def test_cli_and_server(tiny):
    family_checks.assert_cli_and_server(tiny)
