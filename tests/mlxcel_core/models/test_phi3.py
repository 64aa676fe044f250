"""Phi-3 parity with transformers on tiny random checkpoints (fp32, 2 layers, hidden 64, head_dim 16).

assert_parity uses a 64-token prompt and 32 greedy steps, so the last position is 95: original_max 32 puts
the whole run on the long factors, 128 keeps it on the short ones.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from parity import assert_parity, load_quiet, prompt_ids, reference, save_tiny_checkpoint

from mlxcel_core.models.rope import LongRoPE

SHORT = [1.0, 1.1, 1.3, 1.6, 2.0, 2.6, 3.3, 4.1]
LONG = [1.2, 1.9, 3.1, 4.6, 7.2, 9.8, 14.0, 19.5]
BASE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    initializer_range=0.1,
    pad_token_id=0,
    bos_token_id=None,
    eos_token_id=2,
)


def longrope(short=SHORT, long=LONG, **extra):
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": list(short),
        "long_factor": list(long),
        **extra,
    }


VARIANTS = {
    "default-rope": dict(max_position_embeddings=512),
    "longrope-long": dict(max_position_embeddings=128, original_max_position_embeddings=32, rope_parameters=longrope()),
    "longrope-short": dict(
        max_position_embeddings=512, original_max_position_embeddings=128, rope_parameters=longrope()
    ),
    "longrope-partial-tied": dict(
        max_position_embeddings=256,
        original_max_position_embeddings=32,
        tie_word_embeddings=True,
        rope_parameters=longrope(SHORT[:4], LONG[:4], partial_rotary_factor=0.5),
    ),
    "sliding-window-16": dict(
        max_position_embeddings=128, original_max_position_embeddings=32, sliding_window=16, rope_parameters=longrope()
    ),
}


def save(tmp_path, **config):
    from transformers import Phi3Config, Phi3ForCausalLM

    return save_tiny_checkpoint(tmp_path, Phi3Config, Phi3ForCausalLM, **{**BASE, **config})


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_phi3_matches_transformers(tmp_path, variant):
    assert_parity(save(tmp_path, **VARIANTS[variant]))


def test_variants_exercise_what_they_claim(tmp_path):
    """The longrope checkpoints use LongRoPE with a real attention factor; the window changes transformers' logits."""
    path = save(tmp_path / "long", **VARIANTS["longrope-long"])
    rope = load_quiet(path).model.layers[0].self_attn.rope
    assert isinstance(rope, LongRoPE) and rope.mscale > 1.0 and rope.original_max_position_embeddings == 32
    partial = save(tmp_path / "partial", **VARIANTS["longrope-partial-tied"])
    assert load_quiet(partial).model.layers[0].self_attn.rope.dims == 8

    windowed = save(tmp_path / "window", **VARIANTS["sliding-window-16"])
    full = save(tmp_path / "full", **VARIANTS["longrope-long"])
    prompt = prompt_ids(64)
    assert np.abs(reference(windowed, prompt, 1)[0] - reference(full, prompt, 1)[0]).max() > 1e-2


def test_su_alias_and_top_level_original_max(tmp_path):
    """Older Phi-3 configs: rope_scaling {"type": "su"} and original_max_position_embeddings outside it."""
    path = save(tmp_path, **VARIANTS["longrope-long"])
    ref_logits, _ = reference(path, prompt_ids(64), 1)
    config = json.loads((path / "config.json").read_text())
    params = config.pop("rope_parameters")
    config["rope_theta"] = params["rope_theta"]
    config["rope_scaling"] = {
        "type": "su",
        "short_factor": params["short_factor"],
        "long_factor": params["long_factor"],
    }
    config["original_max_position_embeddings"] = 32
    (path / "config.json").write_text(json.dumps(config))
    model = load_quiet(path).model
    logits = np.array(model(mx.array([prompt_ids(64)])))[0]
    assert np.abs(logits - ref_logits).max() <= 1e-4


def test_cache_crossing_the_longrope_threshold(tmp_path):
    """Documented divergence: transformers re-prefills with long factors when generation crosses
    original_max_position_embeddings; we keep the short-rotated keys. Before the crossing all tokens match."""
    from parity import ours

    path = save(tmp_path, **{**VARIANTS["longrope-long"], "original_max_position_embeddings": 72})
    prompt = prompt_ids(64)
    ref_logits, ref_tokens = reference(path, prompt, 32)
    logits, tokens = ours(path, prompt, 32)
    assert np.abs(logits - ref_logits).max() <= 1e-4
    # Tokens at positions 64..71 are produced by forwards that end at or before position 72.
    assert tokens[:9] == ref_tokens[:9]


def test_quantized_phi3_round_trip(tmp_path):
    """Fused projections quantize and load back through quantize_checkpoint (8-bit, group 64)."""
    import mlx.nn as nn

    from mlxcel_core.quantize import quantize_checkpoint, quantize_model

    src = save(tmp_path / "fp32", **VARIANTS["longrope-long"])
    loaded = load_quiet(quantize_checkpoint(src, tmp_path / "q8", bits=8)).model
    assert isinstance(loaded.layers[0].self_attn.qkv_proj, nn.QuantizedLinear)
    assert isinstance(loaded.layers[0].mlp.gate_up_proj, nn.QuantizedLinear)
    x = mx.array([prompt_ids(64)])
    expected = quantize_model(load_quiet(src).model, bits=8)(x)
    np.testing.assert_array_equal(np.array(loaded(x)), np.array(expected))
