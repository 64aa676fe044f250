"""Tiny random checkpoints of the families with recurrent layers, saved by transformers 5 (no downloads), for the engine
and server tests of their prefix cache (engine/state_snapshots.py). Smaller than the family tests' parity models:
these tests compare mlxcel with itself (prefix cache on and off), not with transformers."""

from __future__ import annotations

from pathlib import Path

from tiny_models import save_tiny_checkpoint

ATTENTION = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1)

# Layers: delta-net, attention (full_attention_interval 2).
QWEN3_5 = dict(
    **ATTENTION,
    num_hidden_layers=2,
    intermediate_size=96,
    head_dim=32,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    full_attention_interval=2,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 1e6,
        "partial_rotary_factor": 0.5,
        "mrope_section": [4, 2, 2],
        "mrope_interleaved": True,
    },
)
# Layers: short convolution, attention, short convolution.
LFM2 = dict(
    **ATTENTION,
    intermediate_size=96,
    num_hidden_layers=3,
    conv_L_cache=3,
    conv_bias=True,
    norm_eps=1e-5,
    tie_word_embeddings=False,
    layer_types=["conv", "full_attention", "conv"],
    rope_parameters={"rope_type": "default", "rope_theta": 5e4},
)
# Blocks: Mamba2, attention, MLP. time_step_limit from 0.02: prompt tokens clamp some steps, decode steps do not.
NEMOTRON_H = dict(
    **ATTENTION,
    intermediate_size=96,
    layers_block_type=["linear_attention", "full_attention", "mlp"],
    head_dim=16,
    mamba_num_heads=8,
    mamba_head_dim=8,
    n_groups=2,
    ssm_state_size=16,
    conv_kernel=4,
    chunk_size=16,
    time_step_limit=(0.02, float("inf")),
    tie_word_embeddings=False,
)
FAMILIES = ("qwen3_5", "lfm2", "nemotron_h")


def save_tiny_recurrent(path: Path, family: str) -> Path:
    """A random tiny checkpoint of `family` (one of FAMILIES) with the tiny ChatML tokenizer, in `path`."""
    import transformers as tf

    config_cls, model_cls, config = {
        "qwen3_5": (tf.Qwen3_5TextConfig, tf.Qwen3_5ForCausalLM, QWEN3_5),
        "lfm2": (tf.Lfm2Config, tf.Lfm2ForCausalLM, LFM2),
        "nemotron_h": (tf.NemotronHConfig, tf.NemotronHForCausalLM, NEMOTRON_H),
    }[family]
    path.mkdir(parents=True, exist_ok=True)
    return save_tiny_checkpoint(path, config_cls, model_cls, **config)
