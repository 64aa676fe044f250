"""LFM2: parity with transformers (gated short convolutions with their recurrent state, attention with q/k norms, the
adjusted feed-forward width, untied LM head) in both config styles, the engine's paths over the convolution state
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
from tiny_configs import LFM2
from transformers import Lfm2Config, Lfm2ForCausalLM

from mlxcel_core.errors import UnsupportedModelError
from mlxcel_core.models.base import has_recurrent_layers


def set_norms(path, seed: int = 0):
    """RMSNorm weights (transformers initializes them to ones) random in [0.5, 1.5), so that each norm is read."""
    from safetensors.numpy import load_file, save_file

    weights = load_file(path / "model.safetensors")
    rng = np.random.default_rng(seed)
    for name, w in weights.items():
        if name.endswith("norm.weight"):
            weights[name] = rng.uniform(0.5, 1.5, w.shape).astype(w.dtype)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def older_style(src, dst):
    """The released checkpoints' config.json: `full_attn_idxs` instead of layer_types, `block_ff_dim` for the
    feed-forward width, `tie_embedding`, `rope_theta` at the top level."""
    path = shutil.copytree(src, dst)
    config = json.loads((path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    types = config.pop("layer_types")
    assert types == LFM2["layer_types"]
    config.update(
        full_attn_idxs=[i for i, kind in enumerate(types) if kind == "full_attention"],
        block_ff_dim=config.pop("intermediate_size"),
        tie_embedding=config.pop("tie_word_embeddings"),
        rope_theta=rope["rope_theta"],
    )
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_tiny_checkpoint(tmp_path_factory.mktemp("lfm2"), Lfm2Config, Lfm2ForCausalLM, **LFM2)
    return set_norms(path)


def test_parity_with_transformers(tiny):
    assert_parity(tiny)


def test_parity_older_config_style(tiny, tmp_path):
    assert_parity(older_style(tiny, tmp_path / "older"))


def test_architecture_follows_config(tiny):
    model = load_quiet(tiny).model
    assert [layer.layer_type for layer in model.layers] == LFM2["layer_types"]
    assert has_recurrent_layers(model) and not model.args.tie_word_embeddings
    assert model.layers[0].feed_forward.gate_proj.weight.shape == (128, 64)
    assert model.layers[0].conv.conv.weight.shape == (64, 1, 3) and "bias" in model.layers[0].conv.conv
    assert model.layers[2].self_attn.rope.base == 5e4
    assert model.kv_layout() == [None, None, (2, 16), None]
    assert model.state_layout()[0] == (((2, 64), None),)


def test_feed_forward_width_without_multiplier():
    """transformers rounds to block_multiple_of only with a multiplier; without adjustment the width is as given."""
    from mlxcel_core.models.lfm2 import ModelArgs

    base = {**LFM2, "vocab_size": 320}
    assert ModelArgs.from_dict({**base, "block_ffn_dim_multiplier": None}).ff_dim == 66
    assert ModelArgs.from_dict({**base, "block_auto_adjust_ff_dim": False}).ff_dim == 100
    assert ModelArgs.from_dict({**base, "layer_types": None}).layer_types == ["full_attention"] * 4


def test_the_convolution_state_carries_across_calls(tiny):
    """A prompt in pieces of 1-3 tokens (shorter than the convolution's reach) gives the whole prompt's last logits:
    the state carries the previous inputs; zeroing it between calls gives other logits."""
    import mlx.core as mx

    from mlxcel_core.cache import make_cache

    model = load_quiet(tiny).model
    prompt = prompt_ids(12, seed=7)
    whole = np.array(model(mx.array([prompt]))[0, -1])
    cache = make_cache(len(model.layers))
    for start in range(0, 12, 2):
        out = model(mx.array([prompt[start : start + 2]]), cache)
    np.testing.assert_allclose(np.array(out[0, -1]), whole, atol=1e-4, rtol=0)
    cache = make_cache(len(model.layers))
    model(mx.array([prompt[:10]]), cache)
    for layer_cache, layer in zip(cache, model.layers):
        if layer.layer_type == "conv":
            layer_cache.update_state([mx.zeros_like(layer_cache.recurrent_state()[0])], 0)
    assert np.abs(np.array(model(mx.array([prompt[10:]]), cache)[0, -1]) - whole).max() > 1e-3


def test_mlx_lm_layout_same_logits(tiny, tmp_path):
    """mlx-lm's conversion (convolution weights in MLX's [C, K, 1] layout) loads to the same logits."""
    import mlx.core as mx

    path = shutil.copytree(tiny, tmp_path / "mlx-lm")
    weights = mx.load(str(path / "model.safetensors"))
    for name, value in weights.items():
        if name.endswith("conv.conv.weight"):
            weights[name] = mx.moveaxis(value, 2, 1)
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    np.testing.assert_allclose(checkpoint_logits(path), checkpoint_logits(tiny), atol=1e-5, rtol=0)


def test_unknown_layer_type_is_refused():
    from mlxcel_core.models.lfm2 import ModelArgs

    with pytest.raises(UnsupportedModelError, match="lfm2 layer_types.*sliding_attention"):
        ModelArgs.from_dict({**LFM2, "vocab_size": 320, "layer_types": ["sliding_attention"] * 4})


def test_engine_paths(tiny):
    family_checks.assert_engine_paths(tiny)


def test_recurrent_state_paths(tiny):
    recurrent_checks.assert_state_paths(tiny, "lfm2")


@pytest.mark.parametrize("bits", family_checks.BITS)
def test_quantized(tiny, tmp_path, bits):
    family_checks.assert_quantized(tiny, tmp_path, bits=(bits,))


def test_cli_and_server(tiny):
    family_checks.assert_cli_and_server(tiny)
