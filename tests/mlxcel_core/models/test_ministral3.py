"""Ministral 3: parity with transformers (YaRN RoPE and the position-dependent query scaling, which a 64-token prompt
takes through six of its steps; a sliding-window tied variant), the older config style, the image-text (mistral3)
checkpoint layout, the scaling per row of a batch, the engine's paths, quantized copies, the CLI and the server."""

from __future__ import annotations

import json
import shutil

import family_checks
import mlx.core as mx
import numpy as np
import pytest
import torch
from parity import (
    assert_parity,
    checkpoint_logits,
    load_quiet,
    load_unfused,
    ours,
    prompt_ids,
    rename_weights,
    save_tiny_checkpoint,
)
from test_qwen3 import set_norms
from transformers import Ministral3Config, Ministral3ForCausalLM
from transformers.models.ministral3.modeling_ministral3 import get_llama_4_attn_scale

from mlxcel_core.errors import UnsupportedModelError
from mlxcel_core.models.ministral3 import query_scale

# Scaling steps every 16 positions (original_max_position_embeddings, also YaRN's pretraining length); beta 0.5 so
# the scale (1 to 2 over the prompt and the greedy steps) shows in the logits.
ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "llama_4_scaling_beta": 0.5,
}
TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # != hidden / heads
    max_position_embeddings=512,
    initializer_range=0.1,
    rope_parameters=ROPE,
)
IDS = dict(eos_token_id=2, bos_token_id=None, pad_token_id=0)
# Every layer slides over 24 keys; tied LM head; YaRN's attention factor != 1 (mscale over mscale_all_dim).
WINDOW_TIED = dict(sliding_window=24, tie_word_embeddings=True, rope_parameters={**ROPE, "mscale": 2.0})
VISION = dict(
    model_type="pixtral",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    head_dim=16,
    image_size=28,
    patch_size=14,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_tiny_checkpoint(
        tmp_path_factory.mktemp("ministral3"), Ministral3Config, Ministral3ForCausalLM, **TEXT, **IDS
    )
    return set_norms(path)


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    """Mistral3ForConditionalGeneration as transformers saves it: nested text_config, the language model's weights
    under `language_model.`, a Pixtral vision tower and the projector."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    text = {**TEXT, **IDS, "model_type": "ministral3", "vocab_size": 320}
    path = tmp_path_factory.mktemp("mistral3") / "mm"
    return save_tiny_checkpoint(
        path,
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        text_config=text,
        vision_config=VISION,
        tie_word_embeddings=False,
        **IDS,
    )


def edit_config(src, dst, edit):
    path = shutil.copytree(src, dst)
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))
    return path


def older_style(config: dict) -> None:
    """rope_theta + rope_scaling (with the scaling beta in it) instead of rope_parameters."""
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}


def test_parity_with_transformers(tiny):
    assert_parity(tiny)


def test_parity_older_config_style(tiny, tmp_path):
    assert_parity(edit_config(tiny, tmp_path / "old", older_style))


def test_parity_sliding_window_tied(tmp_path):
    path = save_tiny_checkpoint(tmp_path, Ministral3Config, Ministral3ForCausalLM, **{**TEXT, **IDS, **WINDOW_TIED})
    assert_parity(set_norms(path))


@pytest.mark.parametrize(
    "rope_change",
    [{"llama_4_scaling_beta": 0.0}, {"original_max_position_embeddings": 32}, {"factor": 1.0}],
    ids=["no-query-scaling", "other-scaling-length", "no-yarn"],
)
def test_rope_parameters_matter(tiny, tmp_path, rope_change):
    reference = checkpoint_logits(tiny)
    changed = edit_config(tiny, tmp_path / "changed", lambda c: c["rope_parameters"].update(rope_change))
    assert np.abs(checkpoint_logits(changed) - reference).max() > 1e-3


def test_query_scale_per_row_is_transformers():
    """Rows at their own offsets (a batch's decode step, chunks): transformers' scale at those absolute positions;
    a left-padded row's negative positions (its pad columns) count as position 0."""
    offsets = mx.array([0, 5, 47, 1000, -3])
    ours_ = np.array(query_scale(offsets, 4, 0.1, 16))
    positions = torch.tensor([[max(o + i, 0) for i in range(4)] for o in offsets.tolist()])
    want = get_llama_4_attn_scale(positions, 0.1, 16).numpy()
    np.testing.assert_allclose(ours_, want, rtol=0, atol=1e-7)
    assert ours_.shape == (5, 1, 4, 1) and np.array(query_scale(33, 3, 0.1, 16)).shape == (1, 1, 3, 1)


def test_fused_projections_keep_the_query_scaling(tiny):
    """Where the CUDA kernel rotates q and k in the fused q/k/v launch (fold_rope), a block that overrides
    project_rotated (this scaling) does not take that launch: it would skip the scaling."""
    from mlxcel_core.backends.cuda.kernels.fused_projections import fuse_projections

    model = load_unfused(tiny).model
    x = mx.random.normal((1, 1, 64), key=mx.random.key(0))
    attn = model.layers[0].self_attn
    want = [np.array(t) for t in attn.project_rotated(x, None, 40)]
    assert fuse_projections(model) > 0
    attn.fused_qkv.fold_rope = True  # as where the kernel runs this projection
    attn.fused_qkv.split_roped = lambda *args: pytest.fail("the fused launch rotated a scaled block's queries")
    for got, expected in zip(attn.project_rotated(x, None, 40), want):
        np.testing.assert_allclose(np.array(got), expected, rtol=0, atol=1e-6)


def test_multimodal_checkpoint_matches_transformers(multimodal, capsys):
    """transformers' Mistral3ForConditionalGeneration on text-only input: its logits and greedy tokens."""
    from transformers import Mistral3ForConditionalGeneration

    config = json.loads((multimodal / "config.json").read_text())
    assert config["model_type"] == "mistral3" and config["text_config"]["model_type"] == "ministral3"
    names = mx.load(str(multimodal / "model.safetensors"))
    assert any(n.startswith("language_model.model.") for n in names) and any(
        n.startswith("vision_tower.") for n in names
    )
    model = Mistral3ForConditionalGeneration.from_pretrained(multimodal, dtype=torch.float32).eval()
    prompt, steps = prompt_ids(64), 40
    ids = torch.tensor([prompt])
    with torch.no_grad():
        want_logits = model(input_ids=ids).logits[0].numpy()
        out = model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, eos_token_id=None)
    logits, tokens = ours(multimodal, prompt, steps)
    assert np.abs(logits - want_logits).max() <= 1e-4
    assert tokens == out[0, len(prompt) :].tolist()


def test_multimodal_notice_and_transformers5_layout(multimodal, tmp_path, capsys):
    """Weights under transformers 5's module names (`model.language_model.`, `model.vision_tower.`, `lm_head.`)
    load to the same logits; loading says the vision tower is left out."""
    from mlxcel_core.loading import load_model

    path = shutil.copytree(multimodal, tmp_path / "t5")
    rename_weights(path)
    notices = []
    model = load_model(str(path), log=notices.append).model
    assert any("mistral3 checkpoint" in n and "vision tower" in n for n in notices), notices
    np.testing.assert_allclose(
        np.array(model(mx.array([prompt_ids(64)]))[0]), checkpoint_logits(multimodal), rtol=0, atol=1e-6
    )


def test_engine_paths(tiny):
    family_checks.assert_engine_paths(tiny)


def test_engine_paths_sliding_window(tmp_path):
    path = save_tiny_checkpoint(tmp_path, Ministral3Config, Ministral3ForCausalLM, **{**TEXT, **IDS, **WINDOW_TIED})
    family_checks.assert_engine_paths(path)


@pytest.mark.parametrize("bits", family_checks.BITS)
def test_quantized(tiny, tmp_path, bits):
    family_checks.assert_quantized(tiny, tmp_path, bits=(bits,))


def test_cli_and_server(tiny):
    family_checks.assert_cli_and_server(tiny)


def test_refuses_without_the_scaling_parameters(tiny, tmp_path):
    path = edit_config(tiny, tmp_path / "no-beta", lambda c: c["rope_parameters"].pop("llama_4_scaling_beta"))
    with pytest.raises(UnsupportedModelError, match="llama_4_scaling_beta"):
        load_quiet(path)


def test_refuses_fp8_checkpoints(tiny, tmp_path):
    """The FP8 releases: float8 weights with a per-tensor weight_scale_inv."""
    path = shutil.copytree(tiny, tmp_path / "fp8")
    weights = mx.load(str(path / "model.safetensors"))
    weights["model.layers.0.self_attn.q_proj.weight_scale_inv"] = mx.array(1.0)
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    with pytest.raises(UnsupportedModelError, match="FP8"):
        load_quiet(path)
