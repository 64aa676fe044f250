"""Gemma 3 (text, and the text tower of image-text checkpoints): parity with transformers on tiny random
checkpoints (sliding window shorter than the prompt, local/global RoPE), old-style config keys, the
multimodal layout, a 4-bit group-64 copy against fp32, and the CLI."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from parity import (
    assert_4bit_near_fp32,
    assert_parity,
    checkpoint_logits,
    prompt_ids,
    reference,
    rename_weights,
    save_tiny_checkpoint,
)

from mlxcel_cli.main import main
from mlxcel_core.quantize import quantize_checkpoint

TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    initializer_range=0.3,
    rms_norm_eps=1e-6,
    sliding_window=16,  # layers 0, 1, 3 slide; the 64-token prompt and 32 greedy steps run far past it
    sliding_window_pattern=3,  # -> layer_types [sliding, sliding, full, sliding]
    query_pre_attn_scalar=24,  # != head_dim
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
    },
)
IDS = dict(eos_token_id=2, bos_token_id=None, pad_token_id=0)
# Untied: greedy decoding of a tied random model settles on repeating one token; untied gives varied tokens.
VARIANTS = {
    "untied": {"tie_word_embeddings": False},
    "tied-final-softcap": {"tie_word_embeddings": True, "final_logit_softcapping": 10.0},
}
VISION = dict(
    model_type="siglip_vision_model",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=28,
    patch_size=14,
)

# Measured on these checkpoints (4-bit, group 64, random N(0, 0.3) weights, so much coarser than on real
# models): max-abs 2.31-3.32 on logits of magnitude up to 9.3-9.7, mean-abs 0.43-0.46, correlation 0.970-0.971.
Q4_MAX_ABS, Q4_MEAN_ABS, Q4_MIN_CORR = 4.0, 0.6, 0.95


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    root = tmp_path_factory.mktemp("gemma3")
    return {
        name: save_tiny_checkpoint(root / name, Gemma3TextConfig, Gemma3ForCausalLM, **TEXT, **IDS, **extra)
        for name, extra in VARIANTS.items()
    }


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    """Gemma3ForConditionalGeneration as transformers saves it: nested text_config, text weights under
    `language_model.model.`, plus vision tower and projector weights."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    path = tmp_path_factory.mktemp("gemma3-mm") / "mm"
    text = {**TEXT, "vocab_size": 320, "tie_word_embeddings": False}
    return save_tiny_checkpoint(
        path,
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        text_config=text,
        vision_config=VISION,
        mm_tokens_per_image=4,
        tie_word_embeddings=False,
        **IDS,
    )


def _edit_config(src, dst, edit):
    path = shutil.copytree(src, dst)
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_and_greedy_match_transformers(checkpoints, variant):
    assert_parity(checkpoints[variant])


def test_pre_transformers5_config_keys(checkpoints, tmp_path):
    """Hub configs written before transformers 5: rope_theta / rope_local_base_freq / rope_scaling and
    sliding_window_pattern instead of per-layer-type rope_parameters and layer_types."""
    path = checkpoints["untied"]
    prompt = prompt_ids(64)
    ref, _ = reference(path, prompt, 1)

    def old_style(config):
        assert config.pop("layer_types") == [
            "sliding_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
        ]
        config.pop("rope_parameters")
        config.update(
            rope_theta=1_000_000.0,
            rope_local_base_freq=100.0,
            sliding_window_pattern=3,
            rope_scaling={"type": "linear", "factor": 8.0},
        )

    old = _edit_config(path, tmp_path / "old", old_style)
    assert np.abs(checkpoint_logits(old, prompt) - ref).max() <= 1e-4
    # Each RoPE is read from its own key: the defaults (10k local, unscaled global) give other logits.
    for key, value in (("rope_local_base_freq", 10_000.0), ("rope_scaling", None)):
        changed = _edit_config(old, tmp_path / key, lambda c: c.update({key: value}))
        assert np.abs(checkpoint_logits(changed, prompt) - ref).max() > 1e-2, key


def test_config_knobs_all_matter(checkpoints, tmp_path):
    path = checkpoints["tied-final-softcap"]
    prompt = prompt_ids(64)
    ref, _ = reference(path, prompt, 1)
    for change in ({"final_logit_softcapping": None}, {"sliding_window": 4096}, {"query_pre_attn_scalar": 16}):
        changed = _edit_config(path, tmp_path / next(iter(change)), lambda c: c.update(change))
        assert np.abs(checkpoint_logits(changed, prompt) - ref).max() > 1e-2, change


def test_multimodal_checkpoint_matches_transformers(multimodal):
    config = json.loads((multimodal / "config.json").read_text())
    assert "text_config" in config and "hidden_size" not in config
    names = mx.load(str(multimodal / "model.safetensors"))
    assert any(n.startswith("language_model.model.") for n in names)
    assert any(n.startswith("vision_tower.") for n in names)
    assert_parity(multimodal)  # transformers' Gemma3ForConditionalGeneration on text-only input


def test_multimodal_transformers5_layout_same_logits(multimodal, tmp_path):
    """Weights under `model.language_model.` (transformers 5's module names) with `model.vision_tower.`, and a
    hub-style text_config that omits default values and its model_type, load to the same logits."""
    from transformers import Gemma3TextConfig

    defaults = Gemma3TextConfig().to_dict()

    def hub_style(config):
        text = config["text_config"]
        config["text_config"] = {
            k: v for k, v in text.items() if k != "model_type" and (k not in defaults or defaults[k] != v)
        }
        assert len(config["text_config"]) < len(text) - 5

    path = _edit_config(multimodal, tmp_path / "t5", hub_style)
    rename_weights(path)
    prompt = prompt_ids(64)
    np.testing.assert_allclose(
        checkpoint_logits(path, prompt), checkpoint_logits(multimodal, prompt), rtol=0, atol=1e-6
    )


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_4bit_quantized_logits_near_fp32(checkpoints, tmp_path, variant):
    src = checkpoints[variant]
    assert_4bit_near_fp32(src, quantize_checkpoint(src, tmp_path / "q4"), Q4_MAX_ABS, Q4_MEAN_ABS, Q4_MIN_CORR)


def test_cli_generate(checkpoints, multimodal, tmp_path, capsys):
    q4 = quantize_checkpoint(checkpoints["tied-final-softcap"], tmp_path / "q4")
    mm_q4 = quantize_checkpoint(multimodal, tmp_path / "mm-q4")  # keeps the nested config.json
    for path in (checkpoints["tied-final-softcap"], q4, multimodal, mm_q4):
        assert main(["generate", "-m", str(path), "-p", "hello", "-n", "4"]) == 0
        _, err = capsys.readouterr()
        assert "error" not in err
