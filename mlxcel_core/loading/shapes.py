"""Known model shapes with random weights: benchmark an architecture at its real size without a checkpoint.

    model, config = build_random_model("llama-3-8b", bits=4)   # random normal * 0.02, quantized (group 64)

Each shape is a config.json-style dict, so the model is built through the same registry as a real
checkpoint (`model_class_for`), and another runtime (mlx-lm) can build the identical architecture.
Layers are generated and quantized one at a time, so a 4-bit 70B never exists in 16-bit all at once.
"""

from __future__ import annotations

from typing import Any

from ..errors import InputError

_LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3-8b": dict(
        model_type="llama",
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    ),
    "llama-3.2-1b": dict(
        model_type="llama",
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        vocab_size=128256,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        rope_scaling=_LLAMA3_ROPE_SCALING,
        tie_word_embeddings=True,
    ),
    "llama-3-70b": dict(
        model_type="llama",
        hidden_size=8192,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        intermediate_size=28672,
        vocab_size=128256,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    ),
    "smollm2-135m": dict(
        model_type="llama",
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
    # zai-org/GLM-4.5-Air (106B total, 12B active): transformers' Glm4MoeConfig defaults are this model's sizes;
    # head_dim 128, q/k/v biases, rope_theta 1e6 as in its config.json (and its Megatron recipe: --kv-channels 128,
    # --add-qkv-bias, --rotary-base 1000000). Layer 0 dense, 45 MoE layers: 128 routed experts (top 8) + 1 shared.
    "glm-4.5-air": dict(
        model_type="glm4_moe",
        hidden_size=4096,
        num_hidden_layers=46,
        num_attention_heads=96,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        n_routed_experts=128,
        num_experts_per_tok=8,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        attention_bias=True,
        use_qk_norm=False,
        partial_rotary_factor=0.5,
        vocab_size=151552,
        rope_theta=1000000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    ),
    # HuggingFaceTB/SmolLM3-3B's config.json: SmolLM3Config's default sizes, rope_theta 5e6, 64k positions; every
    # 4th layer NoPE (no_rope_layer_interval 4, what its no_rope_layers list spells out), no sliding window.
    "smollm3-3b": dict(
        model_type="smollm3",
        hidden_size=2048,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=4,
        intermediate_size=11008,
        vocab_size=128256,
        rope_theta=5000000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=65536,
        no_rope_layer_interval=4,
        tie_word_embeddings=True,
    ),
    # ibm-granite/granite-3.3-8b-instruct's config.json (released values; GraniteConfig's defaults are Llama-7B's).
    "granite-3.3-8b": dict(
        model_type="granite",
        hidden_size=4096,
        num_hidden_layers=40,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=12800,
        vocab_size=49159,
        rope_theta=10000000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        embedding_multiplier=12.0,
        attention_multiplier=0.0078125,
        residual_multiplier=0.22,
        logits_scaling=16.0,
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=True,
    ),
    # allenai/Olmo-3-1025-7B's config.json (transformers 4.57 style): no GQA, dolma2 vocabulary, 65k positions by
    # YaRN x8 over 8192 on the full layers (every 4th); 4096-key windows elsewhere. Builds 7,298,011,136 parameters,
    # the count the Hub lists for it.
    "olmo-3-7b": dict(
        model_type="olmo3",
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        intermediate_size=11008,
        vocab_size=100278,
        rms_norm_eps=1e-6,
        max_position_embeddings=65536,
        sliding_window=4096,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 8192,
            "attention_factor": 1.2079441541679836,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        },
        tie_word_embeddings=False,
    ),
    # mistralai/Ministral-3-8B-Base-2512's text model: Ministral3Config's defaults (that checkpoint's), YaRN x16 over
    # 16384 with the query scaling (beta 0.1) as in its text_config.
    "ministral-3-8b": dict(
        model_type="ministral3",
        hidden_size=4096,
        num_hidden_layers=34,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=131072,
        rms_norm_eps=1e-5,
        max_position_embeddings=262144,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 16.0,
            "original_max_position_embeddings": 16384,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.1,
        },
        tie_word_embeddings=False,
    ),
    # moonshotai/Moonlight-16B-A3B (16B total, 3B active; model_type deepseek_v3, DeepSeek-V2-Lite's size class):
    # its config.json values, as its Megatron recipes also give them (27 layers, hidden 2048, ffn 11264, 16 heads,
    # moe ffn 1408, 2 shared experts, top 6, routed scaling 2.446, rope_theta 50000, eps 1e-5). MLA without q LoRA:
    # latent 512 + rope 64 (576 cached numbers a token and layer); layer 0 dense, 26 MoE layers of 64 routed experts.
    "moonlight-16b-a3b": dict(
        model_type="deepseek_v3",
        hidden_size=2048,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        intermediate_size=11264,
        moe_intermediate_size=1408,
        n_routed_experts=64,
        n_shared_experts=2,
        num_experts_per_tok=6,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.446,
        first_k_dense_replace=1,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        vocab_size=163840,
        rope_theta=50000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    ),
    # google/gemma-4-E4B's text model as its config.json's text_config gives it (Gemma4TextConfig's defaults for the
    # rest: default RoPE 10k on sliding layers, proportional RoPE (a quarter of each head rotating, 1e6) on full
    # ones): 42 layers, 5 sliding (512 keys) per full one, head size 256 / 512 on full layers, 2 KV heads, 256-wide
    # per-layer embeddings over the whole vocabulary, the last 18 layers reading the KV of layers 22 and 23.
    "gemma-4-e4b": dict(
        model_type="gemma4_text",
        hidden_size=2560,
        num_hidden_layers=42,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        global_head_dim=512,
        intermediate_size=10240,
        vocab_size=262144,
        vocab_size_per_layer_input=262144,
        hidden_size_per_layer_input=256,
        num_kv_shared_layers=18,
        use_double_wide_mlp=False,
        sliding_window=512,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 7,
        final_logit_softcapping=30.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
    ),
    # openai/gpt-oss-20b's config.json (transformers 4.55 style): 24 layers alternating 128-key sliding and full
    # attention with sinks, 32 experts (top 4) stored as MXFP4 as released (`quantization_config`): its experts are
    # built as MLX mxfp4 banks whatever --bits says, which quantizes the other layers (attention, router, embeddings).
    "gpt-oss-20b": dict(
        model_type="gpt_oss",
        hidden_size=2880,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=2880,
        num_local_experts=32,
        num_experts_per_tok=4,
        vocab_size=201088,
        sliding_window=128,
        attention_bias=True,
        swiglu_limit=7.0,
        rope_theta=150000,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        quantization_config={
            "quant_method": "mxfp4",
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
        },
    ),
    # meta-llama/Llama-4-Scout-17B-16E(-Instruct)'s text_config (Llama4TextConfig's default sizes): 48 layers, every one
    # MoE (16 experts, top 1, plus the shared expert; interleave_moe_layer_step 1), every 4th NoPE (full attention,
    # temperature-tuned), the others chunked over 8192 positions with the q/k L2 norm; llama3 RoPE x16 from 8192.
    "llama-4-scout": dict(
        model_type="llama4_text",
        hidden_size=5120,
        num_hidden_layers=48,
        num_attention_heads=40,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=8192,
        intermediate_size_mlp=16384,
        num_local_experts=16,
        num_experts_per_tok=1,
        interleave_moe_layer_step=1,
        no_rope_layer_interval=4,
        attention_chunk_size=8192,
        use_qk_norm=True,
        attn_temperature_tuning=True,
        floor_scale=8192,
        attn_scale=0.1,
        vocab_size=202048,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 16.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
        },
        rms_norm_eps=1e-5,
        max_position_embeddings=10485760,
        tie_word_embeddings=False,
    ),
    # For tests: head_dim 32 so quantized KV (--kv-bits) works too. Every matrix's input dimension spans at least
    # two 64-groups: MLX 0.32.4's CUDA quantized_matmul with K == group size and 2+ rows hangs (bf16) or returns
    # wrong values (float32) -- measured on the H200 (benchmarks/RESULTS.md).
    "tiny": dict(
        model_type="llama",
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        intermediate_size=256,
        vocab_size=320,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    ),
}

DTYPES = ("bfloat16", "float16", "float32")
QUANT_GROUP_SIZE = 64


def shape_names() -> list[str]:
    return list(SHAPES)


def add_shape_arguments(parser, default_shape: str = "llama-3.2-1b") -> None:
    """The benchmark scripts' model options: --model-shape, --bits, --dtype, --prompt-tokens (an argparse parser)."""
    parser.add_argument("--model-shape", choices=shape_names(), default=default_shape)
    parser.add_argument("--bits", type=int, choices=(4, 8))
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    parser.add_argument("--prompt-tokens", type=int, default=512)


def shape_config(name: str) -> dict[str, Any]:
    """A copy of the shape's config.json-style dict; InputError for unknown names."""
    if name not in SHAPES:
        raise InputError(f"unknown model shape '{name}' (known: {', '.join(SHAPES)})")
    config = dict(SHAPES[name])
    if "rope_scaling" in config:
        config["rope_scaling"] = dict(config["rope_scaling"])
    return config


def check_shape_options(name: str, bits: int | None, dtype: str) -> None:
    shape_config(name)
    if bits not in (None, 4, 8):
        raise InputError(f"--bits must be 4 or 8, got {bits}")
    if dtype not in DTYPES:
        raise InputError(f"--dtype must be one of {', '.join(DTYPES)}, got '{dtype}'")


def describe_shape(name: str, bits: int | None, dtype: str) -> str:
    short = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}[dtype]
    experts = ", experts mxfp4" if _mxfp4_experts(SHAPES.get(name, {})) else ""
    return f"{name} (random) " + (f"Q{bits} g{QUANT_GROUP_SIZE}" if bits else short) + experts


def _mxfp4_experts(config: dict[str, Any]) -> bool:
    """Whether the shape's checkpoints ship their MoE experts as MXFP4 (gpt-oss's `quantization_config`)."""
    return (config.get("quantization_config") or {}).get("quant_method") == "mxfp4"


def build_random_model(name: str, bits: int | None = None, dtype: str = "bfloat16", seed: int = 0, group=None):
    """Return (model, config): the shape's architecture, weights random normal * 0.02 in `dtype`.

    `group` (size > 1): this rank's tensor-parallel shard. Every rank draws the same whole layer from the
    same seed and keeps its slices before the next layer is drawn, so the shards of all ranks together are
    exactly the single-process model and a rank never holds more than its shard plus one whole layer.

    RMSNorm weights are ones (as at initialisation), so activations keep a realistic scale.
    With `bits`, every Linear and Embedding is quantized with nn.quantize (group size 64, affine),
    the way MLX-quantized checkpoints are; norms stay in `dtype`. A shape whose checkpoints ship MXFP4 experts
    (gpt-oss) gets its expert banks in MLX's mxfp4 mode (group 32), with or without `bits`.
    """
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_unflatten

    from ..models import model_class_for
    from ..models.moe import SwitchLinear
    from ..paths import use_kernel_cache

    use_kernel_cache()  # before anything compiles
    check_shape_options(name, bits, dtype)
    config = shape_config(name)
    model_cls, args_cls = model_class_for(config)
    model = model_cls(args_cls.from_dict(config))
    sharded = group is not None and group.size() > 1
    if sharded:
        from ..distributed.shard import check_shardable

        check_shardable(model, group.size())
    mx_dtype = getattr(mx, dtype)
    key = mx.random.key(seed)

    def quantizable(path: str, module: nn.Module) -> bool:
        return hasattr(module, "to_quantized") and module.weight.shape[-1] % QUANT_GROUP_SIZE == 0

    mxfp4 = _mxfp4_experts(config)

    def quantization(path: str, module: nn.Module) -> bool | dict:
        if mxfp4 and isinstance(module, SwitchLinear):
            return {"group_size": 32, "bits": 4, "mode": "mxfp4"}
        return bool(bits) and quantizable(path, module)

    def randomize(module: nn.Module, skip: str | None = None) -> None:
        nonlocal key
        new = []
        for path, value in tree_flatten(module.parameters()):
            if skip and path.startswith(skip):
                continue
            key, sub = mx.random.split(key)
            if value.ndim >= 2:  # matrices and embeddings
                value = (mx.random.normal(value.shape, key=sub) * 0.02).astype(mx_dtype)
            elif path.endswith("bias"):
                value = mx.zeros(value.shape, dtype=mx_dtype)
            else:  # norm weights
                value = mx.ones(value.shape, dtype=mx_dtype)
            new.append((path, value))
        module.update(tree_unflatten(new), strict=False)
        if bits or mxfp4:
            nn.quantize(
                module,
                group_size=QUANT_GROUP_SIZE,
                bits=bits,
                class_predicate=lambda p, m: (not skip or not p.startswith(skip)) and quantization(p, m),
            )
        mx.eval(module.parameters())

    # One layer at a time: peak memory stays near the final model plus one layer in `dtype`.
    for i, layer in enumerate(model.layers):
        randomize(layer)
        if sharded:
            from ..distributed.shard import shard_layer

            shard_layer(layer, f"model.layers.{i}", {}, group)
            mx.eval(layer.parameters())
    randomize(model, skip="model.layers.")  # embeddings, final norm, LM head
    model.eval()
    from .. import backends

    backends.current().prepare_model(model)  # the backend's kernel modules, where it has any
    return model, config


def count_parameters(model) -> tuple[int, int]:
    """(logical parameter count, bytes in memory): quantized weights count as the values they encode."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from ..models.moe import QuantizedSwitchLinear

    quantized = (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)
    n_params = 0
    n_bytes = 0
    for _, module in model.named_modules():
        own = {k: v for k, v in module.items() if hasattr(v, "size") and hasattr(v, "nbytes")}
        bits = getattr(module, "bits", None) if isinstance(module, quantized) else None
        for name, value in own.items():
            n_bytes += value.nbytes
            if bits and name == "weight":
                n_params += value.size * 32 // bits
            elif bits and name in ("scales", "biases"):
                continue
            else:
                n_params += value.size
    if n_bytes == 0:  # a model without named_modules children: count flat arrays
        for _, value in tree_flatten(model.parameters()):
            n_params += value.size
            n_bytes += value.nbytes
    return n_params, n_bytes
