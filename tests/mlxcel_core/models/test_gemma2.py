"""Gemma 2: parity with transformers on tiny random checkpoints (soft-capping on, sliding window shorter
than the prompt), a 4-bit group-64 copy against fp32, and the CLI."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from parity import assert_4bit_near_fp32, assert_parity, checkpoint_logits, prompt_ids, reference, save_tiny_checkpoint

from mlxcel_cli.main import main
from mlxcel_core.quantize import quantize_checkpoint

CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    initializer_range=0.3,
    rms_norm_eps=1e-6,
    sliding_window=16,  # layers 0 and 2 slide; the 64-token prompt and 32 greedy steps run far past it
    query_pre_attn_scalar=24,  # != head_dim, so a head_dim**-0.5 scale would show
    attn_logit_softcapping=1.0,
    final_logit_softcapping=10.0,  # small enough to bend the tiny model's values
    attn_implementation="eager",
    eos_token_id=2,
    bos_token_id=None,
    pad_token_id=0,
)
# Untied: greedy decoding of a tied random model settles on repeating one token; untied gives varied tokens.
VARIANTS = {"untied": {"tie_word_embeddings": False}, "tied": {"tie_word_embeddings": True}}

# Measured on these checkpoints (4-bit, group 64, random N(0, 0.3) weights, so much coarser than on real
# models): max-abs 3.06-3.20 on logits of magnitude up to 7.2-9.2, mean-abs 0.48-0.49, correlation 0.963-0.964.
Q4_MAX_ABS, Q4_MEAN_ABS, Q4_MIN_CORR = 4.0, 0.6, 0.95


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    root = tmp_path_factory.mktemp("gemma2")
    return {
        name: save_tiny_checkpoint(root / name, Gemma2Config, Gemma2ForCausalLM, **CONFIG, **extra)
        for name, extra in VARIANTS.items()
    }


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_and_greedy_match_transformers(checkpoints, variant):
    assert_parity(checkpoints[variant])


def test_config_knobs_all_matter(checkpoints, tmp_path):
    """The test model is sensitive to each feature: dropping one moves the logits well past the tolerance."""
    path = checkpoints["untied"]
    prompt = prompt_ids(64)
    ref, _ = reference(path, prompt, 1)
    config = json.loads((path / "config.json").read_text())
    for change in (
        {"attn_logit_softcapping": None},
        {"final_logit_softcapping": None},
        {"sliding_window": 4096},
        {"query_pre_attn_scalar": 16},
        {"layer_types": ["full_attention"] * 4},
    ):
        changed = shutil.copytree(path, tmp_path / next(iter(change)))
        (changed / "config.json").write_text(json.dumps({**config, **change}))
        assert np.abs(checkpoint_logits(changed, prompt) - ref).max() > 1e-2, change


def test_layer_types_default_alternates_from_sliding(checkpoints, tmp_path):
    """Configs written before `layer_types` existed: layer 0 slides, then every other layer."""
    path = shutil.copytree(checkpoints["untied"], tmp_path / "old")
    config = json.loads((path / "config.json").read_text())
    assert config.pop("layer_types") == ["sliding_attention", "full_attention"] * 2
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    (path / "config.json").write_text(json.dumps(config))
    prompt = prompt_ids(64)
    np.testing.assert_array_equal(checkpoint_logits(path, prompt), checkpoint_logits(checkpoints["untied"], prompt))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_4bit_quantized_logits_near_fp32(checkpoints, tmp_path, variant):
    src = checkpoints[variant]
    assert_4bit_near_fp32(src, quantize_checkpoint(src, tmp_path / "q4"), Q4_MAX_ABS, Q4_MEAN_ABS, Q4_MIN_CORR)


def test_cli_generate(checkpoints, tmp_path, capsys):
    for path in (checkpoints["tied"], quantize_checkpoint(checkpoints["tied"], tmp_path / "q4")):
        assert main(["generate", "-m", str(path), "-p", "hello", "-n", "4"]) == 0
        _, err = capsys.readouterr()
        assert "error" not in err
