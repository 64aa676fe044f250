"""Granite 3.x dense: parity with transformers on tiny random checkpoints (embedding, attention and residual
multipliers, logits scaling), in transformers 5's config style and the released checkpoints' older one, each
multiplier's effect, the engine paths, quantized copies, the CLI and server (tensor parallelism:
tests/mlxcel_core/distributed/test_tensor_parallel.py)."""

from __future__ import annotations

import json
import shutil

import family_checks
import mlx.core as mx
import numpy as np
import pytest
from parity import assert_parity, checkpoint_logits, load_quiet, save_tiny_checkpoint
from test_qwen3 import set_norms
from transformers import GraniteConfig, GraniteForCausalLM

from mlxcel_core.errors import UnsupportedModelError
from mlxcel_core.models.transformer import times

# Every multiplier away from 1 and from what it replaces (attention: head_dim ** -0.5 = 0.25); rope theta 1e5.
MULTIPLIERS = dict(embedding_multiplier=3.0, attention_multiplier=0.3, residual_multiplier=0.22, logits_scaling=2.5)
CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.1,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    eos_token_id=2,
    bos_token_id=None,
    pad_token_id=0,
    **MULTIPLIERS,
)
# Released Granite 3.x checkpoints tie the LM head; this one also carries every bias.
TIED_BIASES = dict(CONFIG, tie_word_embeddings=True, attention_bias=True, mlp_bias=True)


def rewrite_config(path, dst, **changes):
    """A copy of `path` with config.json keys changed (None deletes the key)."""
    shutil.copytree(path, dst)
    config = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    path = save_tiny_checkpoint(tmp_path_factory.mktemp("granite"), GraniteConfig, GraniteForCausalLM, **CONFIG)
    return set_norms(path)


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    path = save_tiny_checkpoint(
        tmp_path_factory.mktemp("granite-tied"), GraniteConfig, GraniteForCausalLM, **TIED_BIASES
    )
    return set_norms(path)


def test_parity(granite):
    assert_parity(granite)


def test_tied_biases_parity(tied):
    assert_parity(tied)


def test_parity_older_config(granite, tmp_path):
    """rope_theta + rope_scaling null, as the released Granite 3.x config.json files write the RoPE."""
    old = rewrite_config(granite, tmp_path / "old", rope_parameters=None, rope_theta=100000.0)
    config = json.loads((old / "config.json").read_text())
    config["rope_scaling"] = None
    (old / "config.json").write_text(json.dumps(config))
    assert_parity(old)
    np.testing.assert_array_equal(checkpoint_logits(old), checkpoint_logits(granite))


def test_architecture_follows_config(granite, tied):
    model = load_quiet(granite).model
    assert model.layers[0].self_attn.scale == 0.3 and model.layers[0].residual_multiplier == 0.22
    assert model.model.embed_multiplier == 3.0 and model.logits_scaling == 2.5
    assert "lm_head" in model and "bias" not in model.layers[0].self_attn.q_proj
    model = load_quiet(tied).model
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert "lm_head" not in model and "bias" in attn.o_proj and "bias" in mlp.up_proj


@pytest.mark.parametrize("key", sorted(MULTIPLIERS))
def test_each_multiplier_matters(granite, tmp_path, key):
    """Set to 1 (GraniteConfig's default, plain Llama) the multiplier gives other logits."""
    plain = checkpoint_logits(rewrite_config(granite, tmp_path / key, **{key: 1.0}))
    assert np.abs(plain - checkpoint_logits(granite)).max() > 1e-2


def test_logits_scaling_divides_the_logits(granite, tmp_path):
    unscaled = checkpoint_logits(rewrite_config(granite, tmp_path / "unscaled", logits_scaling=1.0))
    np.testing.assert_allclose(checkpoint_logits(granite), unscaled / np.float32(2.5), rtol=1e-6, atol=0)


def test_multipliers_round_as_torch_does():
    """A bfloat16 tensor times a Python float: torch computes in float32 and rounds once; `times` does the same
    (MLX's x * 0.22 would round 0.22 to bfloat16 first)."""
    import torch

    x = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
    want = (torch.tensor(x).to(torch.bfloat16) * 0.22).float().numpy()
    got = np.array(times(mx.array(x).astype(mx.bfloat16), 0.22).astype(mx.float32))
    np.testing.assert_array_equal(got, want)
    assert times(mx.array(x).astype(mx.bfloat16), 0.22).dtype == mx.bfloat16


def test_refusals():
    from mlxcel_core.models import model_class_for

    config = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4, vocab_size=320)
    for extra, message in (
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ):
        full = {**config, "model_type": "granite", **extra}
        model_cls, args_cls = model_class_for(full)
        with pytest.raises(UnsupportedModelError, match=message):
            model_cls(args_cls.from_dict(full))


def test_engine_paths(granite):
    family_checks.assert_engine_paths(granite)


@pytest.mark.parametrize("bits", family_checks.BITS)
def test_quantized(granite, tmp_path, bits):
    family_checks.assert_quantized(granite, tmp_path, bits=(bits,))


def test_cli_and_server(granite):
    family_checks.assert_cli_and_server(granite)
