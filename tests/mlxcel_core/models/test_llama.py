"""Parity with transformers on tiny random Llama checkpoints, through the CLI path's loader."""

from __future__ import annotations

import json

import family_checks
import numpy as np
import pytest
from parity import ours, reference
from tiny_models import save_tiny_llama

PROMPT = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 200, 31]
STEPS = 32

VARIANTS = {
    "default": {},
    "llama3-rope": {
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    },
    "linear-rope": {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
    "tied-bias": {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True},
    "mha-headdim": {"num_key_value_heads": 4, "head_dim": 32},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_and_greedy_match_transformers(tmp_path, variant):
    path = save_tiny_llama(tmp_path, **VARIANTS[variant])
    ref_logits, ref_tokens = reference(path, PROMPT, STEPS)
    logits, tokens = ours(path, PROMPT, STEPS)
    assert np.abs(logits - ref_logits).max() <= 1e-4
    assert tokens == ref_tokens


def test_rope_theta_read_from_either_config_key(tmp_path):
    """transformers 5 writes rope_parameters.rope_theta, older versions a top-level rope_theta."""
    path = save_tiny_llama(tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    ref_logits, _ = reference(path, PROMPT, STEPS)
    config = json.loads((path / "config.json").read_text())
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    (path / "config.json").write_text(json.dumps(config))
    logits, _ = ours(path, PROMPT, STEPS)
    assert np.abs(logits - ref_logits).max() <= 1e-4
    # And the theta matters: the default 10000 would give different logits.
    config["rope_theta"] = 10000.0
    (path / "config.json").write_text(json.dumps(config))
    wrong, _ = ours(path, PROMPT, STEPS)
    assert np.abs(wrong - ref_logits).max() > 1e-3


def test_last_only_is_the_last_position_of_the_full_logits():
    """The engine's prefill asks for the last position only (the LM head skips the rest): same numbers."""
    import mlx.core as mx

    from mlxcel_core.cache import make_cache
    from mlxcel_core.loading.shapes import build_random_model

    model, _ = build_random_model("tiny", dtype="float32", seed=2)
    prompt = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    full = model(prompt, make_cache(len(model.layers)))
    last = model(prompt, make_cache(len(model.layers)), last_only=True)
    assert last.shape == (1, 1, full.shape[-1])
    if mx.default_device() == mx.cpu:
        assert mx.array_equal(last[:, 0], full[:, -1]).item()
    else:  # a GPU picks another matmul kernel for one row than for eight: same values up to rounding
        assert mx.allclose(last[:, 0], full[:, -1], rtol=0, atol=1e-5).item()


# The per-family checks (tests/family_checks.py) on the tiny Llama: the baseline every new family meets.
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("llama"), max_position_embeddings=128)


def test_engine_paths(tiny_llama):
    family_checks.assert_engine_paths(tiny_llama)


@pytest.mark.parametrize("bits", family_checks.BITS)
def test_quantized(tiny_llama, tmp_path, bits):
    family_checks.assert_quantized(tiny_llama, tmp_path, bits=(bits,))


def test_cli_and_server(tiny_llama):
    family_checks.assert_cli_and_server(tiny_llama)
