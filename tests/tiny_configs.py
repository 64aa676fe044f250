"""Tiny transformers configs several test files build the same family from: the family's own tests
(tests/mlxcel_core/models/) and the GGUF tests that convert that checkpoint (tests/mlxcel_core/loading/)."""

import numpy as np
from safetensors.numpy import load_file, save_file

S, F = "sliding_attention", "full_attention"

# Gemma 4: 5 layers, both types; the last 2 reuse the keys of layers 2 (sliding) and 1 (full); full layers have twice
# the head size; the window (8) is far shorter than a 64-token prompt. Non-default RoPE so that each one matters.
GEMMA4_DENSE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    global_head_dim=64,
    layer_types=[S, F, S, S, F],
    num_kv_shared_layers=2,
    use_double_wide_mlp=True,
    hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=320,
    sliding_window=8,
    final_logit_softcapping=15.0,
    rope_parameters={
        S: {"rope_type": "default", "rope_theta": 100.0},
        F: {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 10_000.0},
    },
    tie_word_embeddings=True,
)
# The 26B-A4B's kind of layers: experts beside the dense MLP, K = V full layers with 1 KV head, no per-layer
# embeddings, no KV sharing; layer_types and rope_parameters left to transformers' defaults ([S, S, F]).
GEMMA4_MOE = dict(
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    global_head_dim=64,
    attention_k_eq_v=True,
    num_global_key_value_heads=1,
    hidden_size_per_layer_input=0,
    enable_moe_block=True,
    num_experts=4,
    top_k_experts=2,
    moe_intermediate_size=32,
    sliding_window=8,
    final_logit_softcapping=30.0,
    tie_word_embeddings=False,
)
# DeepSeek-V3: hidden 64, 4 heads; latent 32 + rope 16 (48 cached numbers a token and layer); experts of 64.
DEEPSEEK_V3 = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_rope_head_dim=16,
    qk_nope_head_dim=32,
    v_head_dim=32,
    n_routed_experts=8,
    first_k_dense_replace=1,
    initializer_range=0.1,
)
# GLM-4.5: head_dim 32 != hidden / heads (16); experts of 64 (every matrix quantizable at group 64).
GLM4_MOE = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    n_routed_experts=8,
    attention_bias=True,
    initializer_range=0.1,
)
# GLM-4.5 and GLM-4.5-Air as overrides of GLM4_MOE.
GLM4_MOE_VARIANTS = {
    # 2 groups of 4 experts, the router keeps the best group; renormalized top-2 times 2.5; layer 0 dense.
    "glm-4.5": dict(
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        use_qk_norm=True,
        first_k_dense_replace=1,
        n_shared_experts=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    ),
    # One group; raw sigmoid weights of the top 3; layers 0 and 1 dense; 2 shared experts; 8 of 32 dims rotated.
    "air": dict(
        num_experts_per_tok=3,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=False,
        use_qk_norm=False,
        first_k_dense_replace=2,
        n_shared_experts=2,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
    ),
}
# LFM2 layers: conv, conv, attention, conv. The feed-forward width is adjusted: int(2 * 100 / 3) = 66, times 1.5 = 99,
# rounded up to a multiple of 32 = 128. Convolution biases on, an untied LM head.
LFM2 = dict(
    hidden_size=64,
    intermediate_size=100,
    block_multiple_of=32,
    block_ffn_dim_multiplier=1.5,
    block_auto_adjust_ff_dim=True,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    conv_L_cache=3,
    conv_bias=True,
    norm_eps=1e-5,
    tie_word_embeddings=False,
    initializer_range=0.1,
    layer_types=["conv", "conv", "full_attention", "conv"],
    rope_parameters={"rope_type": "default", "rope_theta": 5e4},
)

GPT_OSS_YARN = {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
# 4 layers sliding over 8 keys at even indices (the default layer_types); 4 experts, top 2; a limit of 0.5 so the
# clamps act on these activations; YaRN over 64 original positions (512 = 8 x 64). (swiglu_alpha keeps its default:
# transformers before 5.24 -- the H200 image has 5.17 -- does not read it.)
GPT_OSS = dict(
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=8,
    swiglu_limit=0.5,
    max_position_embeddings=512,
    rope_parameters={**GPT_OSS_YARN, "rope_theta": 10000.0, "original_max_position_embeddings": 64},
    initializer_range=0.1,
)


def randomize_gpt_oss(path, seed=0, sinks_scale=3.0):
    """A saved tiny gpt-oss checkpoint's biases, norms and sinks made random: transformers initializes biases to zeros
    and norms to ones (random ones, so parity checks each is applied); sinks of a large magnitude move the attention."""
    weights = load_file(path / "model.safetensors")
    rng = np.random.default_rng(seed)
    for name, w in weights.items():
        if name.endswith("sinks"):
            weights[name] = (rng.normal(size=w.shape) * sinks_scale).astype(w.dtype)
        elif name.endswith(("bias", "_bias")):
            weights[name] = (rng.normal(size=w.shape) * 0.2).astype(w.dtype)
        elif name.endswith("norm.weight"):
            weights[name] = rng.uniform(0.5, 1.5, w.shape).astype(w.dtype)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


# Llama 4: chunks of 8 (a 64-token prompt crosses eight); every second layer NoPE (full attention, temperature-tuned,
# its scale stepping every 4 positions at strength 0.5); every second layer MoE (4 experts, top 1); llama3 RoPE scaling.
LLAMA4_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
LLAMA4_TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    intermediate_size_mlp=192,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    initializer_range=0.1,
    attention_chunk_size=8,
    no_rope_layer_interval=2,
    num_local_experts=4,
    num_experts_per_tok=1,
    interleave_moe_layer_step=2,
    attn_temperature_tuning=True,
    floor_scale=4,
    attn_scale=0.5,
    use_qk_norm=True,
    rope_parameters=LLAMA4_ROPE,
)
