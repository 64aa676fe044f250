"""Llama 4 text: parity with transformers (chunked attention on the RoPE layers, NoPE layers with the query
temperature, the weightless q/k norm, interleaved RoPE with llama3 scaling, interleaved sigmoid-routed MoE with a
shared expert), the older config style, an explicit-list variant, the image-text (llama4) checkpoint layout, each
feature's effect on the logits, the engine's paths (batched rows in different chunks), quantized copies, the CLI and
the server, and the refusals."""

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
    logits,
    ours,
    prompt_ids,
    rename_weights,
    save_tiny_checkpoint,
)
from test_qwen3 import set_norms
from tiny_configs import LLAMA4_TEXT
from transformers import Llama4ForCausalLM, Llama4TextConfig

from mlxcel_core.errors import UnsupportedModelError
from mlxcel_core.models.base import causal_mask
from mlxcel_core.models.llama4 import Llama4MoE, ModelArgs, attention_temperature
from mlxcel_core.models.transformer import GatedMLP

IDS = dict(eos_token_id=2, bos_token_id=None, pad_token_id=0)
# Explicit lists instead of intervals (layer 0 NoPE, MoE on layers 0 and 2), top-2 routing, attention biases, a tied
# LM head, the default RoPE (theta 500000) and no q/k norm.
LISTS = dict(
    no_rope_layers=[0, 1, 1, 0],
    moe_layers=[0, 2],
    num_experts_per_tok=2,
    attention_bias=True,
    tie_word_embeddings=True,
    use_qk_norm=False,
    rope_parameters=None,
)
VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=28,
    patch_size=14,
    vision_output_dim=64,
    projector_input_dim=64,
    projector_output_dim=64,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama4")
    path = save_tiny_checkpoint(root, Llama4TextConfig, Llama4ForCausalLM, **LLAMA4_TEXT, **IDS)
    return set_norms(path)


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    """Llama4ForConditionalGeneration as transformers saves it: nested text_config, the language model's weights
    under `language_model.`, the vision model and the projector."""
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    text = {**LLAMA4_TEXT, **IDS, "vocab_size": 320}
    path = tmp_path_factory.mktemp("llama4-mm") / "mm"
    save_tiny_checkpoint(path, Llama4Config, Llama4ForConditionalGeneration, text_config=text, vision_config=VISION)
    return set_norms(path)


def edit_config(src, dst, edit):
    path = shutil.copytree(src, dst)
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))
    return path


def older_style(config: dict) -> None:
    """As the released checkpoints' text_config (transformers 4.51): rope_theta + rope_scaling, and no layer_types,
    moe_layers or no_rope_layers (derived from the intervals here)."""
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    for key in ("layer_types", "moe_layers", "no_rope_layers"):
        config.pop(key)


def test_parity_with_transformers(tiny):
    assert_parity(tiny)


def test_parity_older_config_style(tiny, tmp_path):
    assert_parity(edit_config(tiny, tmp_path / "old", older_style))


def test_parity_explicit_lists_top2_bias_tied(tmp_path):
    path = save_tiny_checkpoint(tmp_path, Llama4TextConfig, Llama4ForCausalLM, **{**LLAMA4_TEXT, **IDS, **LISTS})
    assert_parity(set_norms(path))
    model = load_quiet(path).model
    assert [layer.self_attn.uses_rope for layer in model.layers] == [False, True, True, False]
    assert [isinstance(layer.feed_forward, Llama4MoE) for layer in model.layers] == [True, False, True, False]
    assert "lm_head" not in model and "bias" in model.layers[0].self_attn.q_proj


def test_architecture_follows_config(tiny):
    model = load_unfused(tiny).model
    attns = [layer.self_attn for layer in model.layers]
    assert [a.chunk for a in attns] == [8, None, 8, None]  # RoPE layers chunked, NoPE layers full
    assert [a.uses_rope for a in attns] == [True, False, True, False]
    assert [a.l2_qk_norm for a in attns] == [True, False, True, False]
    assert [a.temperature for a in attns] == [None, (4.0, 0.5), None, (4.0, 0.5)]
    assert attns[0].rope.traditional  # interleaved pairs, as transformers' complex multiplication
    assert [type(layer.feed_forward) for layer in model.layers] == [GatedMLP, Llama4MoE, GatedMLP, Llama4MoE]
    assert model.layers[0].feed_forward.gate_proj.weight.shape == (192, 64)  # intermediate_size_mlp
    moe = model.layers[1].feed_forward
    assert moe.experts.gate_proj.weight.shape == (4, 128, 64) and moe.experts.down_proj.weight.shape == (4, 64, 128)
    assert moe.shared_expert.gate_proj.weight.shape == (128, 64)


def without_chunks(attn):
    attn.chunk = None


def with_rope(attn, rope):
    attn.uses_rope, attn.rope = True, rope


def without_l2_norm(attn):
    attn.l2_qk_norm = False


def without_temperature(attn):
    attn.temperature = None


@pytest.mark.parametrize(
    "layer, change",
    [(0, without_chunks), (1, "rope"), (0, without_l2_norm), (1, without_temperature)],
    ids=["chunking", "nope", "l2-qk-norm", "temperature-tuning"],
)
def test_each_feature_changes_the_logits(tiny, layer, change):
    """Chunked attention, the NoPE layers' skipped RoPE, the q/k L2 norm and the temperature tuning each reach the
    64-token prompt's logits (so parity checks them)."""
    model = load_quiet(tiny).model
    reference = logits(model)
    attn = model.layers[layer].self_attn
    if change == "rope":
        with_rope(attn, model.layers[0].self_attn.rope)
    else:
        change(attn)
    assert np.abs(logits(model) - reference).max() > 1e-3


def test_attention_temperature_per_row_is_transformers():
    """Rows at their own offsets (a batch's decode step): transformers' scales at those absolute positions; a
    left-padded row's negative positions count as position 0."""
    offsets = mx.array([0, 3, 47, 1000, -3])
    got = np.array(attention_temperature(offsets, 4, 4.0, 0.5))
    positions = torch.tensor([[max(o + i, 0) for i in range(4)] for o in offsets.tolist()]).float()
    want = (torch.log1p(torch.floor((positions + 1.0) / 4)) * 0.5 + 1.0).numpy()
    np.testing.assert_allclose(got[:, 0, :, 0], want, rtol=0, atol=1e-7)
    assert got.shape == (5, 1, 4, 1) and np.array(attention_temperature(9, 3, 4.0, 0.5)).shape == (1, 1, 3, 1)


def test_chunked_mask_is_transformers():
    """causal_mask(chunk=) against transformers' chunked causal mask: per row, chunks start at its first real column
    (left padding), queries aligned with the last keys."""
    from transformers.masking_utils import chunked_causal_mask_function, sdpa_mask

    padding = [0, 3, 11]
    for query_len, key_len in ((20, 20), (1, 20), (5, 20)):
        got = causal_mask(query_len, key_len, mx.array(padding), None, 4)
        attention_mask = torch.tensor([[0] * p + [1] * (key_len - p) for p in padding], dtype=torch.bool)
        want = sdpa_mask(
            batch_size=3,
            q_length=query_len,
            kv_length=key_len,
            q_offset=key_len - query_len,
            mask_function=chunked_causal_mask_function(4, torch.tensor(padding)),
            attention_mask=attention_mask,
            allow_is_causal_skip=False,
        )
        real = [slice(max(p, key_len - query_len) - (key_len - query_len), None) for p in padding]  # real queries
        for row, rows in enumerate(real):
            np.testing.assert_array_equal(np.array(got[row, 0])[rows], want[row, 0].numpy()[rows])
    unpadded = np.array(causal_mask(20, 20, None, None, 4)[0, 0])
    assert unpadded[9].tolist() == [False] * 8 + [True, True] + [False] * 10
    assert causal_mask(8, 8, None, None, 8) == "causal"  # one chunk: the plain causal mask


def test_multimodal_checkpoint_matches_transformers(multimodal):
    """The checkpoint as transformers' Llama4ForConditionalGeneration loads it, on text-only input: its language
    model's logits and greedy tokens (what the wrapper's forward computes for text; transformers 5.24's wrapper forward
    itself fails on its return value, reading `image_outputs` from the language model's output)."""
    from transformers import Llama4ForConditionalGeneration

    config = json.loads((multimodal / "config.json").read_text())
    assert config["model_type"] == "llama4" and config["text_config"]["model_type"] == "llama4_text"
    names = mx.load(str(multimodal / "model.safetensors"))
    assert any(n.startswith("language_model.model.") for n in names)
    assert any(n.startswith("vision_model.") for n in names)
    model = Llama4ForConditionalGeneration.from_pretrained(multimodal, dtype=torch.float32).eval().language_model
    prompt, steps = prompt_ids(64), 40
    ids = torch.tensor([prompt])
    with torch.no_grad():
        want_logits = model(input_ids=ids).logits[0].numpy()
        out = model.generate(
            ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    got_logits, tokens = ours(multimodal, prompt, steps)
    assert np.abs(got_logits - want_logits).max() <= 1e-4
    assert tokens == out[0, len(prompt) :].tolist()


def test_multimodal_notice_and_other_layout(multimodal, tmp_path):
    """Weights under `model.language_model.` / `lm_head.` / `model.vision_model.` load to the same logits; loading
    says that the vision tower is left out."""
    from mlxcel_core.loading import load_model

    path = shutil.copytree(multimodal, tmp_path / "t5")
    rename_weights(path)
    notices = []
    model = load_model(str(path), log=notices.append).model
    assert any("llama4 checkpoint" in n and "vision tower" in n for n in notices), notices
    np.testing.assert_allclose(logits(model), checkpoint_logits(multimodal), rtol=0, atol=1e-6)


def test_engine_paths(tiny):
    """Batched rows of 23, 1, 9 and 40 tokens decode in different chunks (and at different temperatures)."""
    family_checks.assert_engine_paths(tiny)


@pytest.mark.parametrize("bits", family_checks.BITS)
def test_quantized(tiny, tmp_path, bits):
    family_checks.assert_quantized(tiny, tmp_path, bits=(bits,))


def test_cli_and_server(tiny):
    family_checks.assert_cli_and_server(tiny)


def test_released_config_values():
    """Released text_configs write attn_temperature_tuning as 4 (on), an empty no_rope_layers (the interval's) and
    llama3 rope_scaling; Scout's NoPE layers are every fourth."""
    args = ModelArgs.from_dict(
        dict(
            num_hidden_layers=8,
            attn_temperature_tuning=4,
            no_rope_layers=[],
            rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 16.0, "original_max_position_embeddings": 8192},
        )
    )
    assert args.no_rope_layers == [1, 1, 1, 0, 1, 1, 1, 0] and args.moe_layers == list(range(8))
    assert args.layer_types == ["chunked_attention"] * 3 + ["full_attention"] + ["chunked_attention"] * 3 + [
        "full_attention"
    ]
    assert args.attn_temperature_tuning and args.rope_base == 500000.0 and args.rope_scaling["rope_type"] == "llama3"


def test_tensor_parallelism_needs_dividing_heads(tiny):
    """Loading as rank 0 of 2 shards; of 4, it is refused (tests/mlxcel_core/distributed/
    test_tensor_parallel_families.py runs the ranks). Checked the way a rank loads: before the backend swaps in its
    kernel modules."""
    from tiny_models import FakeGroup

    from mlxcel_core.loading import load_model

    load_model(str(tiny), log=lambda m: None, group=FakeGroup(0, 2))
    with pytest.raises(UnsupportedModelError, match="4 query heads and 2 KV heads"):
        load_model(str(tiny), log=lambda m: None, group=FakeGroup(0, 4))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"layer_types": ["sliding_attention"] * 4}, "layer_types"),
        ({"attention_chunk_size": None}, "attention_chunk_size"),
        ({"no_rope_layers": [1, 0]}, "no_rope_layers"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "dynamic"),
    ],
    ids=["layer-type", "chunks-without-size", "short-no-rope-layers", "activation", "rope-type"],
)
def test_refusals(tiny, tmp_path, change, message):
    path = edit_config(tiny, tmp_path / "changed", lambda c: c.update(change))
    with pytest.raises(UnsupportedModelError, match=message):
        load_quiet(path)


def test_refuses_fp8_checkpoints(tiny, tmp_path):
    """The FP8 releases: float8 weights with a weight_scale per tensor."""
    path = shutil.copytree(tiny, tmp_path / "fp8")
    weights = mx.load(str(path / "model.safetensors"))
    weights["model.layers.0.self_attn.q_proj.weight_scale"] = mx.array(1.0)
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    with pytest.raises(UnsupportedModelError, match="FP8"):
        load_quiet(path)


def test_bench_shape_builds_scaled_down(monkeypatch):
    """`mlxcel bench --model-shape llama-4-scout`, scaled down (its MoE on every layer, every 4th NoPE, chunks, llama3
    RoPE with equal low and high frequency factors): it builds at 4 bits and a forward crossing a chunk is finite."""
    from mlxcel_core.loading import shapes
    from mlxcel_core.models.moe import QuantizedSwitchLinear

    small = dict(shapes.SHAPES["llama-4-scout"], hidden_size=128, num_hidden_layers=4, num_local_experts=4)
    small.update(num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=128, vocab_size=256)
    small.update(intermediate_size_mlp=256, attention_chunk_size=4, floor_scale=2)
    monkeypatch.setitem(shapes.SHAPES, "llama-4-scout-small", small)
    model, _ = shapes.build_random_model("llama-4-scout-small", bits=4, dtype="float32")
    assert all(isinstance(layer.feed_forward, Llama4MoE) for layer in model.layers)
    assert isinstance(model.layers[0].feed_forward.experts.gate_proj, QuantizedSwitchLinear)
    assert [layer.self_attn.chunk for layer in model.layers] == [4, 4, 4, None]
    out = model(mx.array([list(range(1, 11))]))
    assert out.shape == (1, 10, 256) and mx.all(mx.isfinite(out)).item()
