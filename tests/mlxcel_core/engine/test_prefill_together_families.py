"""Whole prompts prefilled together (the GPU default) in every model family: sliding windows
shorter than the prompts, attention and final soft-capping, q/k norms, per-layer RoPE, longrope, fused q/k/v,
experts. Each padded row's first-token logits match its prompt prefilled alone, and every sequence's greedy tokens
are its solo run's; bf16 and 4-bit random models (the GPU's decode kernels, there) by their first-token logits."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import mlx.core as mx
import pytest
from parity import load_quiet, prompt_ids, save_tiny_checkpoint

from mlxcel_core.backends.cuda.kernels import fast_linear
from mlxcel_core.bench import RandomIdTokenizer
from mlxcel_core.engine import Engine, EngineConfig
from mlxcel_core.loading.shapes import build_random_model
from mlxcel_core.sampling import SamplingParams

SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.1,
)
# family -> (transformers config and model class names, config)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),  # q/k/v biases
    "qwen3-window": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(head_dim=32, use_sliding_window=True, sliding_window=8, max_window_layers=1),
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0)),
    # head_dim 16: 8 factors; 128 positions past an original 32 (the long factors, as transformers picks them)
    "phi3-longrope-window": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            pad_token_id=0,
            max_position_embeddings=128,
            original_max_position_embeddings=32,
            sliding_window=8,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0 + i / 4 for i in range(8)],
                "long_factor": [1.2 + i for i in range(8)],
            },
        ),
    ),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    # attention sinks (std 0.3) on a sliding layer and a full one; biased router and experts
    "gpt-oss-window": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8, initializer_range=0.3),
    ),
    # partial rotary, q/k norms and biases; layer 1 grouped MoE (2 groups of 4, the best one kept)
    "glm4-moe": (
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        dict(
            head_dim=32,
            moe_intermediate_size=64,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            use_qk_norm=True,
            attention_bias=True,
            routed_scaling_factor=2.5,
        ),
    ),
    # layer 1 NoPE and sliding (no_rope_layer_interval 2, use_sliding_window)
    "smollm3-nope-window": (
        "SmolLM3Config",
        "SmolLM3ForCausalLM",
        dict(no_rope_layer_interval=2, use_sliding_window=True, sliding_window=8, pad_token_id=0),
    ),
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(embedding_multiplier=3.0, attention_multiplier=0.3, residual_multiplier=0.22, logits_scaling=2.5),
    ),
    "qwen3-moe-window": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            head_dim=16,
            moe_intermediate_size=128,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            use_sliding_window=True,
            sliding_window=8,
        ),
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            head_dim=16,
            sliding_window=8,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=1.0,
            final_logit_softcapping=10.0,
            initializer_range=0.3,
            attn_implementation="eager",
            pad_token_id=0,
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            head_dim=16,
            num_hidden_layers=3,
            sliding_window=8,
            sliding_window_pattern=2,
            query_pre_attn_scalar=24,
            initializer_range=0.3,
            pad_token_id=0,
        ),
    ),
    # sliding / full layers of head size 16 / 32 (proportional RoPE), per-layer embeddings; layers 2 and 3 read the
    # KV of layers 0 and 1
    "gemma4-kv-shared": (
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        dict(
            num_hidden_layers=4,
            head_dim=16,
            global_head_dim=32,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            num_kv_shared_layers=2,
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=320,
            sliding_window=8,
            final_logit_softcapping=10.0,
            pad_token_id=0,
        ),
    ),
    # post-norm layers, whole-projection q/k norms; layer 0 slides, layer 1 is full with YaRN
    "olmo3-window": (
        "Olmo3Config",
        "Olmo3ForCausalLM",
        dict(
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0},
                "full_attention": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
            },
            pad_token_id=0,
        ),
    ),
    # the query scaling steps every 8 positions: padded rows' positions (from 0 after their padding) decide it
    "ministral3": (
        "Ministral3Config",
        "Ministral3ForCausalLM",
        dict(
            head_dim=16,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 8,
                "llama_4_scaling_beta": 0.5,
            },
            pad_token_id=0,
        ),
    ),
    # layer 0 chunked over 8 positions (counted from each padded row's start) with the q/k L2 norm, layer 1 NoPE with
    # the query temperature (stepping every 4 positions) and the sigmoid-routed MoE
    "llama4-chunked": (
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        dict(
            head_dim=16,
            intermediate_size_mlp=128,
            attention_chunk_size=8,
            no_rope_layer_interval=2,
            num_local_experts=4,
            interleave_moe_layer_step=2,
            floor_scale=4,
            attn_scale=0.5,
            pad_token_id=0,
        ),
    ),
    # a gated delta-net layer (its recurrent state: the padded columns must leave it untouched) and a gated full
    # attention layer with partial rotary; MoE with a gated shared expert
    "qwen3-next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        dict(
            head_dim=16,
            layer_types=["linear_attention", "full_attention"],
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        ),
    ),
    "qwen3.5": (
        "Qwen3_5TextConfig",
        "Qwen3_5ForCausalLM",
        dict(
            head_dim=16,
            layer_types=["linear_attention", "full_attention"],
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
        ),
    ),
    # a gated short-convolution layer (its state: the padded columns, biased, must leave it untouched) and an
    # attention layer with q/k norms
    "lfm2": (
        "Lfm2Config",
        "Lfm2ForCausalLM",
        dict(layer_types=["conv", "full_attention"], conv_bias=True),
    ),
    # a Mamba2 block (its conv and scan state: the padded columns must leave them untouched), a grouped MoE block
    # and a NoPE attention block
    "nemotron-h": (
        "NemotronHConfig",
        "NemotronHForCausalLM",
        dict(
            layers_block_type=["linear_attention", "moe", "full_attention"],
            head_dim=16,
            mamba_num_heads=8,
            mamba_head_dim=8,
            n_groups=2,
            ssm_state_size=16,
            chunk_size=16,
            n_routed_experts=4,
            moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=32,
        ),
    ),
    # latent attention (one latent key a token, the values its prefix) with q LoRA and YaRN's mscale_all_dim; layer
    # 1 grouped MoE (2 groups of 4, the best one kept)
    "deepseek-v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            num_key_value_heads=4,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_rope_head_dim=16,
            qk_nope_head_dim=32,
            v_head_dim=32,
            moe_intermediate_size=64,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            max_position_embeddings=128,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "mscale": 1.0,
                "mscale_all_dim": 0.7,
            },
        ),
    ),
}
# Left-padded to 23: past every window above. And three prompts of 1-2 tokens (6 padded rows: few enough that a
# 16-bit or 4-bit model's rows would take the decode kernels on a GPU; these float32 checkpoints keep MLX's ops there).
PROMPT_LENGTHS = {"long": (5, 23, 1, 14), "short": (2, 1, 2)}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    import transformers

    config_cls, model_cls, extra = FAMILIES[request.param]
    path = save_tiny_checkpoint(
        tmp_path_factory.mktemp(request.param),
        getattr(transformers, config_cls),
        getattr(transformers, model_cls),
        **{**SMALL, **extra},
    )
    return load_quiet(path)


def _engine(loaded, together: int) -> Engine:
    config = EngineConfig(
        max_batch_size=4, storage="paged", block_size=8, prefix_cache=False, prefill_batch_size=together
    )
    # (a chunk that takes every prompt padded, whatever the backend's default)
    return Engine(loaded.model, loaded.tokenizer, dataclasses.replace(config, prefill_chunk_size=2048))


def _prompts(vocab: int, lengths: str) -> list[list[int]]:
    return [prompt_ids(n, vocab=min(vocab, 320), seed=i) for i, n in enumerate(PROMPT_LENGTHS[lengths])]


def _first_logits_match(loaded, prompts, rtol: float) -> None:
    """Each padded row's first-token logits against its prompt prefilled alone, within rtol of the largest."""
    engine = _engine(loaded, 4)
    seq_ids = tuple(range(len(prompts)))
    for seq_id, prompt in zip(seq_ids, prompts):
        engine.storage.add(seq_id, prompt)
    together = engine.runner.prefill_together(seq_ids, prompts)
    for seq_id, prompt in zip(seq_ids, prompts):
        alone = _engine(loaded, 1)
        alone.storage.add(0, prompt)
        want = alone.runner.prefill(0, prompt, 0, True)[0]
        scale = mx.abs(want).max().item()
        assert mx.allclose(together[seq_id], want, rtol=rtol, atol=rtol * max(1.0, scale)).item(), seq_id


@pytest.mark.parametrize("lengths", sorted(PROMPT_LENGTHS))
def test_first_logits_match_each_prompt_alone(family, lengths):
    _first_logits_match(family, _prompts(family.model.args.vocab_size, lengths), 1e-4)


@pytest.mark.parametrize("lengths", sorted(PROMPT_LENGTHS))
@pytest.mark.parametrize("bits", [None, 4], ids=["bf16", "4-bit"])
def test_sixteen_bit_and_4_bit_rows_match_alone(monkeypatch, bits, lengths):
    """A bf16 and a 4-bit model as load_model prepares them: on a GPU the short prompts' rows (6 padded) take the
    decode kernels, fused q/k/v with RoPE at each padded row's position; elsewhere MLX's ops. On CPU the rows come
    out exact (measured), and 1e-3 of the largest logit fails RoPE positions without the padding (6e-3 bf16, 3e-2
    4-bit, checked); on a GPU, 2e-2 leaves room for MLX's batched matmuls rounding differently."""
    monkeypatch.setattr(fast_linear, "MIN_WEIGHT", 0)  # (the tiny 4-bit layers on the kernel too)
    model, config = build_random_model("tiny", bits=bits, dtype="bfloat16", seed=3)
    loaded = SimpleNamespace(model=model, tokenizer=RandomIdTokenizer(config["vocab_size"]))
    rtol = 2e-2 if mx.default_device().type == mx.DeviceType.gpu else 1e-3
    _first_logits_match(loaded, _prompts(config["vocab_size"], lengths), rtol)


@pytest.mark.parametrize("lengths", sorted(PROMPT_LENGTHS))
def test_greedy_tokens_match_one_prompt_at_a_time(family, lengths):
    prompts = _prompts(family.model.args.vocab_size, lengths)

    def run(together: int) -> dict[int, list[int]]:
        engine = _engine(family, together)
        real, calls = engine.runner.prefill_together, []
        engine.runner.prefill_together = lambda ids, chunks, *more: calls.append(len(ids)) or real(ids, chunks, *more)
        ids = {engine.open(prompt, SamplingParams(max_tokens=12)): i for i, prompt in enumerate(prompts)}
        tokens: dict[int, list[int]] = {i: [] for i in ids.values()}
        while engine.has_work():
            for out in engine.step():
                if out.token is not None:
                    tokens[ids[out.seq_id]].append(out.token)
        assert engine.storage.stats()["blocks_free"] == engine.storage.pool.num_blocks  # nothing leaked
        assert calls == ([len(prompts)] if together > 1 else [])  # all at once, or one at a time
        return tokens

    solo, together = run(1), run(4)
    assert together == solo and sum(map(len, solo.values())) > 2 * len(prompts)  # (not all stopped at once)
