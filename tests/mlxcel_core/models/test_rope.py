"""RoPE variants against transformers: inverse frequencies, attention factor, and the rotated vectors.

The rotated vectors are checked against a numpy port of transformers' apply_rotary_pos_emb fed with the
cos/sin transformers' own rotary-embedding module produces (attention factor included), so a missing or
misplaced mscale, a wrong partial-rotary split or a wrong short/long choice all fail here.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
import torch
from parity import assert_parity
from tiny_models import save_tiny_llama

from mlxcel_core.models.rope import LongRoPE, initialize_rope, rope_frequencies, standardize_scaling

SHORT = [1.0, 1.1, 1.3, 1.6, 2.0, 2.6, 3.3, 4.1]
LONG = [1.2, 1.9, 3.1, 4.6, 7.2, 9.8, 14.0, 19.5]

# name -> (config class name, config kwargs); head_dim = hidden_size / num_attention_heads unless given.
CASES = {
    "default-10k": ("llama", dict(head_dim=64, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "default-500k-128": ("llama", dict(head_dim=128, rope_parameters={"rope_type": "default", "rope_theta": 5e5})),
    "linear-4": ("llama", dict(head_dim=64, rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0})),
    "llama3.1": (
        "llama",
        dict(
            head_dim=128,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 5e5,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
    ),
    "llama3-tiny": (
        "llama",
        dict(
            head_dim=16,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 5e5,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "yarn-qwen2.5": (
        "llama",
        dict(
            head_dim=128,
            max_position_embeddings=131072,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 1e6,
                "factor": 4.0,
                "original_max_position_embeddings": 32768,
            },
        ),
    ),
    "yarn-mscale-ratio": (
        "llama",
        dict(
            head_dim=64,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 1e4,
                "factor": 40.0,
                "mscale": 1.0,
                "mscale_all_dim": 0.8,
                "original_max_position_embeddings": 4096,
            },
        ),
    ),
    "yarn-untruncated": (
        "llama",
        dict(
            head_dim=64,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 4096,
            },
        ),
    ),
    "yarn-explicit-partial": (
        "llama",
        dict(
            head_dim=32,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 1e4,
                "factor": 8.0,
                "attention_factor": 1.3,
                "beta_fast": 16,
                "beta_slow": 2,
                "partial_rotary_factor": 0.5,
                "original_max_position_embeddings": 256,
            },
        ),
    ),
    "longrope-phi3": (
        "phi3",
        dict(
            max_position_embeddings=131072,
            original_max_position_embeddings=4096,
            rope_parameters={"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG},
        ),
    ),
    "longrope-explicit": (
        "llama",
        dict(
            head_dim=16,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 1e4,
                "factor": 8.0,
                "attention_factor": 1.2,
                "short_factor": SHORT,
                "long_factor": LONG,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "su-partial": (
        "phi3",
        dict(
            max_position_embeddings=512,
            original_max_position_embeddings=64,
            rope_parameters={
                "type": "su",
                "partial_rotary_factor": 0.5,
                "short_factor": SHORT[:4],
                "long_factor": LONG[:4],
                "original_max_position_embeddings": 64,
            },
        ),
    ),
}


def hf_config(name):
    kind, kwargs = CASES[name]
    kwargs = {**kwargs, "rope_parameters": dict(kwargs["rope_parameters"])}  # transformers edits it in place
    if kind == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(hidden_size=4 * kwargs["head_dim"], num_attention_heads=4, **kwargs)
    from transformers import Phi3Config

    return Phi3Config(hidden_size=64, num_attention_heads=4, **kwargs)


def ours(name):
    """(rotary dims, base, standardized scaling, head_dim) read from the raw kwargs as a family's ModelArgs would."""
    kind, kwargs = CASES[name]
    params = dict(kwargs["rope_parameters"])
    head_dim = kwargs.get("head_dim", 16)
    dims = int(head_dim * params.get("partial_rotary_factor", 1.0))
    raw_kind = params.get("rope_type", params.get("type"))
    scaling = None if raw_kind == "default" else {**params, "rope_type": raw_kind}
    scaling = standardize_scaling(
        scaling, kwargs.get("max_position_embeddings", 2048), kwargs.get("original_max_position_embeddings")
    )
    return dims, float(params.get("rope_theta", 10000.0)), scaling, head_dim


def hf_frequencies(config, seq_len=None):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    kind = config.rope_parameters["rope_type"]
    if kind == "default":
        inv_freq, factor = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        inv_freq, factor = ROPE_INIT_FUNCTIONS[kind](config, seq_len=seq_len)
    return inv_freq.numpy(), factor


def seq_lens(name):
    scaling = ours(name)[2]
    if scaling is None or scaling["rope_type"] != "longrope":
        return [None]
    original = scaling["original_max_position_embeddings"]
    return [None, original, original + 1]


@pytest.mark.parametrize("name", sorted(CASES))
def test_inv_freq_and_attention_factor_match_transformers(name):
    config = hf_config(name)
    dims, base, scaling, _ = ours(name)
    for seq_len in seq_lens(name):
        ref_inv, ref_factor = hf_frequencies(config, seq_len)
        inv, factor = rope_frequencies(dims, base, scaling, seq_len)
        np.testing.assert_allclose(np.array(inv), ref_inv, rtol=2e-6, atol=0)
        assert factor == pytest.approx(ref_factor, rel=1e-12)
    if scaling is not None and scaling["rope_type"] in ("yarn", "longrope"):
        assert factor != pytest.approx(1.0)  # the case exercises the attention factor


def rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rotary_pos_emb(x, cos, sin):
    """numpy port of transformers' apply_rotary_pos_emb for one tensor [B, H, L, D]; cos/sin [B, L, rot]."""
    cos, sin = cos[:, None], sin[:, None]
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return np.concatenate([x_rot * cos + rotate_half(x_rot) * sin, x_pass], axis=-1)


def hf_cos_sin(config, positions):
    """cos/sin from transformers' own rotary module (attention factor and longrope switch included)."""
    if config.model_type == "phi3":
        from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding as Rotary
    else:
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding as Rotary
    with torch.no_grad():
        cos, sin = Rotary(config)(torch.zeros(1, dtype=torch.float32), torch.tensor([positions]))
    return cos.numpy().astype(np.float64), sin.numpy().astype(np.float64)


def offsets(name):
    scaling = ours(name)[2]
    if scaling is not None and scaling["rope_type"] == "longrope":
        original = scaling["original_max_position_embeddings"]
        return [(0, 7), (original - 7, 7), (original - 6, 7), (original + 100, 1)]  # short, short, long, long
    return [(0, 9), (1000, 1)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_rotated_vectors_match_apply_rotary_pos_emb(name):
    config = hf_config(name)
    dims, base, scaling, head_dim = ours(name)
    rope = initialize_rope(dims, base, False, scaling)
    rng = np.random.default_rng(0)
    for offset, length in offsets(name):
        x = rng.standard_normal((1, 2, length, head_dim)).astype(np.float32)
        cos, sin = hf_cos_sin(config, list(range(offset, offset + length)))
        expected = apply_rotary_pos_emb(x.astype(np.float64), cos, sin)
        got = np.array(rope(mx.array(x), offset))
        # float32 angles at position ~4k: a few ulp of 4k radians.
        tol = 1e-5 if offset + length < 100 else 2e-3
        np.testing.assert_allclose(got, expected, atol=tol, rtol=0, err_msg=f"offset {offset}, length {length}")


def test_longrope_with_per_row_offsets_picks_factors_per_row():
    dims, base, scaling, head_dim = ours("longrope-explicit")
    rope = initialize_rope(dims, base, False, scaling)
    assert isinstance(rope, LongRoPE)
    x = mx.array(np.random.default_rng(1).standard_normal((2, 2, 1, head_dim)).astype(np.float32))
    original = scaling["original_max_position_embeddings"]
    rows = rope(x, mx.array([original - 1, original]))  # row 0 ends at original (short), row 1 past it (long)
    np.testing.assert_allclose(np.array(rows[:1]), np.array(rope(x[:1], original - 1)), atol=1e-6)
    np.testing.assert_allclose(np.array(rows[1:]), np.array(rope(x[1:], original)), atol=1e-6)
    assert not np.allclose(np.array(rope(x[1:], original - 1)), np.array(rope(x[1:], original)), atol=1e-3)


def test_yarn_attention_factor_is_on_both_q_and_k():
    """Attention logits carry factor**2, as transformers' scaled cos/sin on q and k give."""
    dims, base, scaling, head_dim = ours("yarn-qwen2.5")
    rope = initialize_rope(dims, base, False, scaling)
    plain = initialize_rope(dims, base, False, {**scaling, "attention_factor": 1.0})
    q = mx.array(np.random.default_rng(2).standard_normal((1, 1, 4, head_dim)).astype(np.float32))
    ratio = np.array((rope(q) @ rope(q).swapaxes(-1, -2)) / (plain(q) @ plain(q).swapaxes(-1, -2)))
    np.testing.assert_allclose(ratio, (0.1 * math.log(4.0) + 1.0) ** 2, rtol=1e-5)


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32},
        {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "short_factor": SHORT,
            "long_factor": LONG,
            "original_max_position_embeddings": 32,
        },
    ],
    ids=["yarn", "longrope"],
)
def test_llama_checkpoint_with_scaled_rope_matches_transformers(tmp_path, rope_parameters):
    """End to end through a family that uses initialize_rope: the attention factor lands in the logits."""
    path = save_tiny_llama(tmp_path, rope_parameters=rope_parameters, max_position_embeddings=512)
    assert_parity(path)


def test_unknown_rope_type_is_a_clear_error():
    from mlxcel_core.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="rope scaling type 'dynamic' is not supported"):
        initialize_rope(16, 10000.0, False, {"rope_type": "dynamic", "factor": 2.0})
