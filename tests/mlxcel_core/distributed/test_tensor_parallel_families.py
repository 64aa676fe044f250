"""Tensor parallelism of the 2026 families (issue 36): `--tp-size 2` gives the single process's greedy tokens.

Each tiny checkpoint has random norms and biases (transformers saves ones and zeros), so a norm weight sliced to the
wrong heads, a bias added on both ranks or a sink kept whole changes the tokens.
"""

from __future__ import annotations

import pytest
from parity import load_quiet, randomize_norms_and_biases, save_tiny_checkpoint
from ranks import two_ranks_here
from tiny_configs import (
    DEEPSEEK_V3,
    GEMMA4_DENSE,
    GEMMA4_MOE,
    GLM4_MOE,
    GLM4_MOE_VARIANTS,
    GPT_OSS,
    LLAMA4_TEXT,
    randomize_gpt_oss,
)
from tiny_models import FakeGroup
from tp_checks import TINY, assert_tp_matches, mlxcel

from mlxcel_core.loading import load_model

PROMPT = "The capital of France is Paris. A quick brown fox jumps over the lazy dog, and then"
SLIDING, FULL = "sliding_attention", "full_attention"


def olmo3(path):
    from transformers import Olmo3Config, Olmo3ForCausalLM

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}
    path = save_tiny_checkpoint(
        path,
        Olmo3Config,
        Olmo3ForCausalLM,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.1,
        sliding_window=8,
        max_position_embeddings=128,  # YaRN's factor x original positions
        rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 500000.0}, FULL: yarn},
        eos_token_id=2,
        bos_token_id=None,
        pad_token_id=0,
    )
    return randomize_norms_and_biases(path)


def glm4_moe(path):
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    config = {**GLM4_MOE, **GLM4_MOE_VARIANTS["glm-4.5"]}
    path = save_tiny_checkpoint(path, Glm4MoeConfig, Glm4MoeForCausalLM, **config)
    return randomize_norms_and_biases(path, mtp_layer=GLM4_MOE["num_hidden_layers"])


def gpt_oss(path):
    from transformers import GptOssConfig, GptOssForCausalLM

    return randomize_gpt_oss(save_tiny_checkpoint(path, GptOssConfig, GptOssForCausalLM, **GPT_OSS))


def llama4(path):
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    ids = dict(eos_token_id=2, bos_token_id=None, pad_token_id=0)
    path = save_tiny_checkpoint(path, Llama4TextConfig, Llama4ForCausalLM, **LLAMA4_TEXT, **ids)
    return randomize_norms_and_biases(path)


def deepseek_v3(path, q_lora_rank):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    routing = dict(num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5, n_shared_experts=1)
    path = save_tiny_checkpoint(
        path,
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        **DEEPSEEK_V3,
        **routing,
        q_lora_rank=q_lora_rank,
        attention_bias=q_lora_rank is None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return randomize_norms_and_biases(path, mtp_layer=DEEPSEEK_V3["num_hidden_layers"])


def gemma4(path, config):
    """KV-shared layers, per-layer inputs and two head sizes (dense); experts beside the MLP, normed after their sum,
    and keys as values (MoE, with 2 KV heads on its full layers so that they divide)."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    ids = dict(max_position_embeddings=512, initializer_range=0.1, eos_token_id=2, bos_token_id=None, pad_token_id=0)
    path = save_tiny_checkpoint(path, Gemma4TextConfig, Gemma4ForCausalLM, **config, **ids)
    return randomize_norms_and_biases(path)


def gemma(path, version):
    """Sandwich norms, sliding and global layers; Gemma 2 soft-caps the attention logits, Gemma 3 norms q and k per
    head with (1 + w) gains."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    config, model, extra = {
        2: (Gemma2Config, Gemma2ForCausalLM, dict(attn_logit_softcapping=1.0, attn_implementation="eager")),
        3: (Gemma3TextConfig, Gemma3ForCausalLM, {}),
    }[version]
    path = save_tiny_checkpoint(
        path,
        config,
        model,
        **extra,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        initializer_range=0.1,
        sliding_window=8,
        query_pre_attn_scalar=24,
        layer_types=[SLIDING, SLIDING, FULL, SLIDING],
        eos_token_id=2,
        bos_token_id=None,
        pad_token_id=0,
    )
    return randomize_norms_and_biases(path)


def phi3(path):
    """Fused q/k/v and gate/up projections (each rank takes its slice of each part), LongRoPE past the original
    positions, a sliding window."""
    from transformers import Phi3Config, Phi3ForCausalLM

    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.6, 3.3, 4.1]}
    path = save_tiny_checkpoint(
        path,
        Phi3Config,
        Phi3ForCausalLM,
        **TINY,
        max_position_embeddings=128,
        original_max_position_embeddings=16,
        sliding_window=12,
        rope_parameters={**rope, "long_factor": [1.2, 1.9, 3.1, 4.6, 7.2, 9.8, 14.0, 19.5]},
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=2,
    )
    return randomize_norms_and_biases(path)


FAMILIES = {
    "olmo3": olmo3,
    "glm4_moe": glm4_moe,
    "gpt_oss": gpt_oss,
    "llama4": llama4,
    "deepseek_v3-q-lora": lambda path: deepseek_v3(path, q_lora_rank=32),
    "deepseek_v3-moonlight": lambda path: deepseek_v3(path, q_lora_rank=None),
    "gemma4-dense": lambda path: gemma4(path, GEMMA4_DENSE),
    "gemma4-moe": lambda path: gemma4(path, {**GEMMA4_MOE, "num_global_key_value_heads": 2}),
    "gemma2": lambda path: gemma(path, 2),
    "gemma3": lambda path: gemma(path, 3),
    "phi3": phi3,
}


@two_ranks_here
@pytest.mark.parametrize("family", list(FAMILIES))
def test_tp2_greedy_equals_single_process(family, tmp_path):
    assert_tp_matches(FAMILIES[family](tmp_path), prompt=PROMPT)


@two_ranks_here
@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3-q-lora", "phi3"])
def test_tp2_greedy_equals_single_process_4bit(family, tmp_path):
    """A 4-bit copy (groups of 32, so each rank's slice of a down projection is whole groups): packed experts,
    per-head latent maps and fused projections' parts sliced with their scales."""
    source = FAMILIES[family](tmp_path / "source")
    out = tmp_path / "q4"
    result = mlxcel("convert", str(source), "-o", str(out), "-q", "--q-group-size", "32")
    assert result.returncode == 0, result.stderr
    assert_tp_matches(out, prompt=PROMPT)


def test_rank_1_holds_its_heads_norm_slices_sinks_and_no_expert_bias(tmp_path):
    """In process (no collective runs): gpt-oss's sinks and OLMo 3's whole-projection norms are sliced with the heads;
    a per-expert down bias stays on rank 0 only."""
    import mlx.core as mx

    from mlxcel_core.distributed.parallel_layers import SplitRMSNorm

    path = gpt_oss(tmp_path / "gpt_oss")
    full = load_quiet(path).model
    part = load_model(str(path), log=lambda m: None, group=FakeGroup(1, 2)).model
    fa, pa = full.layers[0].self_attn, part.layers[0].self_attn
    assert mx.array_equal(pa.sinks, fa.sinks[2:])
    full_down, part_down = full.layers[0].mlp.experts.down_proj, part.layers[0].mlp.experts.down_proj
    assert mx.array_equal(part_down.weight, full_down.weight[..., 32:])
    assert not mx.any(part_down.bias).item() and mx.any(full_down.bias).item()
    rank0 = load_model(str(path), log=lambda m: None, group=FakeGroup(0, 2)).model.layers[0].mlp.experts.down_proj
    assert mx.array_equal(rank0.bias, full_down.bias)

    path = olmo3(tmp_path / "olmo3")
    fa = load_quiet(path).model.layers[0].self_attn
    pa = load_model(str(path), log=lambda m: None, group=FakeGroup(1, 2)).model.layers[0].self_attn
    assert isinstance(pa.q_norm, SplitRMSNorm) and pa.q_norm.dims == 64
    assert mx.array_equal(pa.q_norm.weight, fa.q_norm.weight[32:])
    assert mx.array_equal(pa.k_norm.weight, fa.k_norm.weight[16:])
