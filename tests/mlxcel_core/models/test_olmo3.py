"""OLMo 3: parity with transformers (post-norm layers, q/k norms over the whole projections, three sliding layers
and a full one, YaRN on the full layer only), the older config style of the released checkpoints, what each
feature changes, the engine's paths, quantized copies, the CLI and the server."""

from __future__ import annotations

import json
import shutil

import family_checks
import numpy as np
import pytest
from parity import assert_parity, checkpoint_logits, load_quiet, save_tiny_checkpoint
from test_qwen3 import set_norms
from transformers import Olmo3Config, Olmo3ForCausalLM

from mlxcel_core.errors import UnsupportedModelError

SLIDING, FULL = "sliding_attention", "full_attention"
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "attention_factor": 1.2}
# Default layer_types (sliding, sliding, sliding, full); 16-key windows on the 64-token prompt. The full layer's
# YaRN base (10000) differs from the sliding layers' (500000), as the older style below resolves them.
CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.1,
    sliding_window=16,
    rope_parameters={
        SLIDING: {"rope_type": "default", "rope_theta": 500000.0},
        FULL: {**YARN, "rope_theta": 10000.0},
    },
    eos_token_id=2,
    bos_token_id=None,
    pad_token_id=0,
)


@pytest.fixture(scope="module")
def tiny_olmo3(tmp_path_factory):
    path = save_tiny_checkpoint(tmp_path_factory.mktemp("olmo3"), Olmo3Config, Olmo3ForCausalLM, **CONFIG)
    return set_norms(path)  # random q/k norms and post norms: parity checks each is applied where transformers does


def edit_config(src, dst, edit):
    path = shutil.copytree(src, dst)
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))
    return path


def older_style(config: dict) -> None:
    """config.json as transformers 4.57 wrote OLMo 3's: rope_theta + rope_scaling (for the full layers), and no
    layer_types where they are the default pattern."""
    assert config.pop("layer_types") == [SLIDING, SLIDING, SLIDING, FULL]
    config.pop("rope_parameters")
    config.update(rope_theta=10000.0, rope_scaling=YARN)


def test_parity_with_transformers(tiny_olmo3):
    assert_parity(tiny_olmo3)


def test_parity_older_config_style(tiny_olmo3, tmp_path):
    """The released checkpoints' keys. transformers 5.24 gives rope_theta to the full layers only: the sliding
    layers keep 500000 (as the fixture has them)."""
    path = edit_config(tiny_olmo3, tmp_path / "old", older_style)
    assert_parity(path)
    model = load_quiet(path).model
    assert [layer.self_attn.rope.base for layer in model.layers[:3]] == [500000.0] * 3


def test_architecture_follows_config(tiny_olmo3):
    model = load_quiet(tiny_olmo3).model
    layer = model.layers[0]
    assert "input_layernorm" not in layer
    assert layer.post_feedforward_layernorm.weight.shape == (64,)
    assert layer.self_attn.q_norm.weight.shape == (4 * 16,) and layer.self_attn.k_norm.weight.shape == (2 * 16,)
    assert [layer.self_attn.window for layer in model.layers] == [16, 16, 16, None]
    assert model.layers[3].self_attn.rope.mscale == 1.2 and model.layers[0].self_attn.rope.mscale == 1.0


@pytest.mark.parametrize(
    "suffixes",
    [("q_norm.weight", "k_norm.weight"), ("post_attention_layernorm.weight",), ("post_feedforward_layernorm.weight",)],
    ids=["qk-norms", "post-attention-norm", "post-feedforward-norm"],
)
def test_each_norm_reaches_the_logits(tiny_olmo3, tmp_path, suffixes):
    reference = checkpoint_logits(tiny_olmo3)
    path = set_norms(shutil.copytree(tiny_olmo3, tmp_path / "unit"), value=1.0, suffixes=suffixes)
    assert np.abs(checkpoint_logits(path) - reference).max() > 1e-3


@pytest.mark.parametrize(
    "change",
    [
        {"sliding_window": 4096},  # the window
        {"layer_types": [SLIDING, FULL, SLIDING, SLIDING]},  # which layers slide (and take YaRN)
        {"rope_parameters": {SLIDING: {"rope_type": "default", "rope_theta": 500000.0}, FULL: {"rope_theta": 1e4}}},
    ],
    ids=["window", "layer-types", "no-yarn"],
)
def test_config_keys_matter(tiny_olmo3, tmp_path, change):
    reference = checkpoint_logits(tiny_olmo3)
    path = edit_config(tiny_olmo3, tmp_path / "changed", lambda c: c.update(change))
    assert np.abs(checkpoint_logits(path) - reference).max() > 1e-3


def test_engine_paths(tiny_olmo3):
    family_checks.assert_engine_paths(tiny_olmo3)


@pytest.mark.parametrize("bits", family_checks.BITS)
def test_quantized(tiny_olmo3, tmp_path, bits):
    family_checks.assert_quantized(tiny_olmo3, tmp_path, bits=(bits,))


def test_cli_and_server(tiny_olmo3):
    family_checks.assert_cli_and_server(tiny_olmo3)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "keyed by layer type"),
        ({"layer_types": [SLIDING, "chunked_attention", SLIDING, FULL]}, "chunked_attention"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
    ids=["flat-rope-parameters", "layer-type", "activation"],
)
def test_refuses_what_it_does_not_implement(tiny_olmo3, tmp_path, change, message):
    path = edit_config(tiny_olmo3, tmp_path / "refused", lambda c: c.update(change))
    with pytest.raises(UnsupportedModelError, match=message):
        load_quiet(path)
