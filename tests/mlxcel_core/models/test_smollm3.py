"""SmolLM3: parity with transformers on tiny random checkpoints (NoPE layers, sliding NoPE layers, YaRN), in
transformers 5's config style and the released checkpoints' older one, the engine paths, quantized copies, the CLI
and server, and the refusals."""

from __future__ import annotations

import json
import shutil

import family_checks
import numpy as np
import pytest
from parity import assert_parity, checkpoint_logits, load_quiet, load_unfused, save_tiny_checkpoint
from test_qwen3 import set_norms
from transformers import SmolLM3Config, SmolLM3ForCausalLM

from mlxcel_core.errors import UnsupportedModelError
from mlxcel_core.models.rope import RoPE
from mlxcel_core.models.smollm3 import ModelArgs, NoPE

SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.1,
    eos_token_id=2,
    bos_token_id=None,
    pad_token_id=0,  # SmolLM3Config's 128004 is outside the tiny vocabulary
)
# Layers 1 and 3 are NoPE (explicit list); theta 1e4 so that RoPE moves the logits a lot; untied LM head.
NOPE = dict(
    SMALL,
    no_rope_layers=[1, 0, 1, 0],
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    tie_word_embeddings=False,
)
# As SmolLM3Config derives them: NoPE every 2nd layer (1, 3), which slide over 16 keys of the 64-token prompt;
# default theta (2e6), tied embeddings, biases everywhere.
SLIDING = dict(
    SMALL,
    no_rope_layer_interval=2,
    use_sliding_window=True,
    sliding_window=16,
    attention_bias=True,
    mlp_bias=True,
)


def older_style(path, dst, drop=("layer_types",)):
    """A copy of `path` whose config.json is written as transformers 4.5x wrote SmolLM3-3B's: `rope_theta` +
    `rope_scaling` (null for the default RoPE) instead of `rope_parameters`, the unused `max_window_layers`, and
    without the keys in `drop` (SmolLM3Config derives them)."""
    shutil.copytree(path, dst)
    config = json.loads((dst / "config.json").read_text())
    rope = dict(config.pop("rope_parameters"))
    if "rope_theta" not in drop:
        config["rope_theta"] = rope.pop("rope_theta")
    rope.pop("rope_theta", None)
    config["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
    config["max_window_layers"] = 28
    for key in drop:
        config.pop(key, None)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def nope(tmp_path_factory):
    path = save_tiny_checkpoint(tmp_path_factory.mktemp("smollm3-nope"), SmolLM3Config, SmolLM3ForCausalLM, **NOPE)
    return set_norms(path)


@pytest.fixture(scope="module")
def sliding(tmp_path_factory):
    path = save_tiny_checkpoint(
        tmp_path_factory.mktemp("smollm3-sliding"), SmolLM3Config, SmolLM3ForCausalLM, **SLIDING
    )
    return set_norms(path)


def test_nope_parity(nope):
    assert_parity(nope)


def test_nope_parity_older_config(nope, tmp_path):
    """rope_theta + rope_scaling null, no layer_types (derived), as the released SmolLM3-3B config.json."""
    old = older_style(nope, tmp_path / "old")
    assert "rope_parameters" not in json.loads((old / "config.json").read_text())
    assert_parity(old)
    np.testing.assert_array_equal(checkpoint_logits(old), checkpoint_logits(nope))


def test_sliding_parity(sliding):
    assert_parity(sliding)


def test_sliding_parity_older_config(sliding, tmp_path):
    """No rope_theta (SmolLM3's default 2e6), no no_rope_layers (from no_rope_layer_interval), no layer_types
    (sliding NoPE layers from use_sliding_window + sliding_window)."""
    old = older_style(sliding, tmp_path / "old", drop=("layer_types", "no_rope_layers", "rope_theta"))
    config = json.loads((old / "config.json").read_text())
    assert not {"layer_types", "no_rope_layers", "rope_theta", "rope_parameters"} & set(config)
    assert_parity(old)
    np.testing.assert_array_equal(checkpoint_logits(old), checkpoint_logits(sliding))


def test_yarn_parity(tmp_path):
    """SmolLM3's long-context setting: YaRN on the RoPE layers, none on the NoPE layers."""
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}
    path = save_tiny_checkpoint(tmp_path, SmolLM3Config, SmolLM3ForCausalLM, **{**NOPE, "rope_parameters": rope})
    assert_parity(set_norms(path))


def test_architecture_follows_config(nope, sliding):
    for path in (nope, sliding):
        layers = load_quiet(path).model.layers
        ropes = [layer.self_attn.rope for layer in layers]  # (a backend may swap a RoPE for a subclass)
        assert [isinstance(r, RoPE) for r in ropes] == [True, False, True, False]
        assert [type(r) is NoPE for r in ropes] == [False, True, False, True]
    sliding_layers = load_quiet(sliding).model.layers
    assert [layer.self_attn.window for layer in sliding_layers] == [None, 16, None, 16]
    assert "bias" in sliding_layers[0].self_attn.o_proj and "bias" in sliding_layers[0].mlp.down_proj
    assert [layer.self_attn.window for layer in load_quiet(nope).model.layers] == [None] * 4


def test_nope_layers_skip_rope(nope, tmp_path):
    """With RoPE on every layer (no_rope_layers all 1) the same weights give other logits."""
    path = shutil.copytree(nope, tmp_path / "all-rope")
    config = json.loads((path / "config.json").read_text())
    config["no_rope_layers"] = [1, 1, 1, 1]
    (path / "config.json").write_text(json.dumps(config))
    assert np.abs(checkpoint_logits(path) - checkpoint_logits(nope)).max() > 1e-2


def test_config_derivations():
    base = dict(hidden_size=64, num_hidden_layers=8, intermediate_size=128, num_attention_heads=4, vocab_size=320)
    args = ModelArgs.from_dict(base)
    assert args.uses_rope == [True, True, True, False] * 2 and args.windows == [None] * 8
    assert args.rope_base == 2_000_000.0 and args.num_key_value_heads == 4 and args.tie_word_embeddings
    args = ModelArgs.from_dict({**base, "use_sliding_window": True, "sliding_window": 8})
    assert args.windows == [None, None, None, 8] * 2
    # Listed sliding layers slide over sliding_window whatever use_sliding_window says (transformers' masks)
    layer_types = ["sliding_attention", "full_attention"] * 4
    args = ModelArgs.from_dict({**base, "layer_types": layer_types, "sliding_window": 8})
    assert args.windows == [8, None] * 4
    args = ModelArgs.from_dict({**base, "rope_theta": 5e6, "rope_scaling": None, "max_window_layers": 28})
    assert args.rope_base == 5e6 and args.rope_scaling is None


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"no_rope_layers": [1, 0]}, "no_rope_layers lists 2 layers"),
        ({"layer_types": ["sliding_attention", "full_attention"] * 2}, "sliding_window is not set"),
        ({"layer_types": ["chunked_attention"] * 4, "sliding_window": 8}, "chunked_attention"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ],
)
def test_refusals(extra, message):
    from mlxcel_core.models import model_class_for

    config = dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4, vocab_size=320)
    config = {**config, "model_type": "smollm3", **extra}
    model_cls, args_cls = model_class_for(config)
    with pytest.raises(UnsupportedModelError, match=message):
        model_cls(args_cls.from_dict(config))


def test_tensor_parallel_shards_it(sliding):
    """Stock layers (a NoPE layer only has another rope): sharding takes the model as it takes Llama."""
    from mlxcel_core.distributed.shard import check_shardable

    check_shardable(load_unfused(sliding).model, 2)  # (sharding happens before the backend fuses)


def test_engine_paths(sliding):
    family_checks.assert_engine_paths(sliding)


@pytest.mark.parametrize("bits", family_checks.BITS)
def test_quantized(sliding, tmp_path, bits):
    family_checks.assert_quantized(sliding, tmp_path, bits=(bits,))


def test_cli_and_server(sliding):
    family_checks.assert_cli_and_server(sliding)
