"""GGUF architectures: a tiny transformers checkpoint per family, converted to GGUF the way llama.cpp's converter
does (tests/gguf_convert.py: its metadata, tensor names, q/k permutation, +1 norms, stacked experts, rope
factors), must load through our GGUF loader and give transformers' logits and greedy tokens on the original
checkpoint. transformers' own GGUF reader checks the converter's changes independently where it reads the family."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as tf
from gguf_convert import convert
from parity import assert_generate_cli_gives_greedy, loaded_greedy, mlx_class_name, model_reference, prompt_ids
from tiny_models import save_tiny_checkpoint
from typer.testing import CliRunner

from mlxcel_cli.main import app
from mlxcel_core.errors import UnsupportedModelError
from mlxcel_core.loading import load_model

gguf = pytest.importorskip("gguf")

STEPS = 40
PROMPT = prompt_ids(12)
TOL = 2e-4  # F32 file, same weights: only summation order differs (measured max-abs below 1e-5)
SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1)
MOE = dict(num_experts_per_tok=2, intermediate_size=64)
# id -> (GGUF architecture, config class, model class, config, general.name)
CASES = {
    "llama": ("llama", tf.LlamaConfig, tf.LlamaForCausalLM, dict(num_hidden_layers=2), "tiny"),
    "llama3-rope": (
        "llama",
        tf.LlamaConfig,
        tf.LlamaForCausalLM,
        dict(
            num_hidden_layers=2,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
        "tiny",
    ),
    "mistral": ("llama", tf.MistralConfig, tf.MistralForCausalLM, dict(num_hidden_layers=2), "mistral-tiny"),
    "mixtral": (
        "llama",
        tf.MixtralConfig,
        tf.MixtralForCausalLM,
        dict(num_hidden_layers=2, num_local_experts=4, **MOE),
        "mixtral-tiny",
    ),
    "qwen2": ("qwen2", tf.Qwen2Config, tf.Qwen2ForCausalLM, dict(num_hidden_layers=2), "tiny"),
    "qwen3": ("qwen3", tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(num_hidden_layers=2, head_dim=32), "tiny"),
    "qwen3moe": (
        "qwen3moe",
        tf.Qwen3MoeConfig,
        tf.Qwen3MoeForCausalLM,
        dict(num_hidden_layers=2, num_experts=4, moe_intermediate_size=32, norm_topk_prob=True, **MOE),
        "tiny",
    ),
    "gemma2": (
        "gemma2",
        tf.Gemma2Config,
        tf.Gemma2ForCausalLM,
        dict(num_hidden_layers=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8),
        "tiny",
    ),
    "gemma3": (
        "gemma3",
        tf.Gemma3TextConfig,
        tf.Gemma3ForCausalLM,
        dict(
            num_hidden_layers=6,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=8,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        ),
        "tiny",
    ),
    "phi3": ("phi3", tf.Phi3Config, tf.Phi3ForCausalLM, dict(num_hidden_layers=2, pad_token_id=0), "tiny"),
    "phi3-longrope": (  # Phi-4-mini's shape: LongRoPE (short factors up to 32 positions, long after) on half the dims
        "phi3",
        tf.Phi3Config,
        tf.Phi3ForCausalLM,
        dict(
            num_hidden_layers=2,
            pad_token_id=0,
            original_max_position_embeddings=32,
            partial_rotary_factor=0.5,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "long_factor": [1.0, 2.0, 4.0, 8.0],
                "short_factor": [1.0, 1.1, 1.2, 1.5],
            },
        ),
        "tiny",
    ),
    "granite": (
        "granite",
        tf.GraniteConfig,
        tf.GraniteForCausalLM,
        dict(
            num_hidden_layers=2,
            embedding_multiplier=6.0,
            attention_multiplier=0.2,
            residual_multiplier=0.5,
            logits_scaling=4.0,
        ),
        "tiny",
    ),
    "smollm3": (
        "smollm3",
        tf.SmolLM3Config,
        tf.SmolLM3ForCausalLM,
        dict(num_hidden_layers=4, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, pad_token_id=0),
        "tiny",
    ),
    "olmo2": ("olmo2", tf.Olmo2Config, tf.Olmo2ForCausalLM, dict(num_hidden_layers=2, pad_token_id=0), "tiny"),
    "olmo3": (
        "olmo2",
        tf.Olmo3Config,
        tf.Olmo3ForCausalLM,
        dict(
            num_hidden_layers=4,
            sliding_window=8,
            pad_token_id=0,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 32,
                    "attention_factor": 1.2,
                    "rope_theta": 10000.0,
                },
            },
        ),
        "tiny",
    ),
    "gpt-oss": (
        "gpt-oss",
        tf.GptOssConfig,
        tf.GptOssForCausalLM,
        dict(
            num_hidden_layers=2,
            intermediate_size=64,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,  # swiglu_limit keeps its 7.0: llama.cpp's gpt-oss has it fixed, the file has no key
            rope_parameters={
                "rope_type": "yarn",
                "factor": 8.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "rope_theta": 10000.0,
                "original_max_position_embeddings": 64,
            },
        ),
        "tiny",
    ),
}
# A prompt past original_max_position_embeddings (32): its forward and every later step use the long factors. The
# short prompt checks the short factors by its logits alone: a generation that crosses 32 positions switches
# factors mid-sequence, where our phi3 family and transformers differ by design (models/rope.py, LongRoPE).
LONG_PROMPTS = {"phi3-longrope": prompt_ids(40, seed=1)}
TIED = {"gemma2", "gemma3", "smollm3"}  # as their released checkpoints (no output.weight in the file)
# Families whose GGUF form transformers reads itself (transformers/integrations/ggml.py) into the same model. Not
# qwen3 (its reader ignores attention.key_length; our case has head_dim != hidden / heads) nor gemma2 (it reads no
# query scale and defaults to 256; llama.cpp, and we, take head_dim).
TRANSFORMERS_READS = ["llama", "mistral", "qwen2", "phi3"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Per case: (HF checkpoint dir, GGUF path), built on first use."""
    built = {}

    def get(case):
        if case not in built:
            arch, config_cls, model_cls, extra, name = CASES[case]
            hf_dir = save_tiny_checkpoint(
                tmp_path_factory.mktemp(f"{case}-hf"),
                config_cls,
                model_cls,
                **{**SMALL, "max_position_embeddings": 512, "tie_word_embeddings": arch in TIED, **extra},
            )
            # Its own directory, so transformers cannot pick up the HF config.json / tokenizer.json instead.
            path = convert(hf_dir, tmp_path_factory.mktemp(f"{case}-gguf") / f"{case}.gguf", arch, name=name)
            built[case] = (hf_dir, path)
        return built[case]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_matches_the_original_checkpoint(files, case):
    hf_dir, path = files(case)
    hf = tf.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    loaded = load_model(str(path), log=lambda m: None)
    prompts = [PROMPT, LONG_PROMPTS[case]] if case in LONG_PROMPTS else [PROMPT]
    for prompt in prompts:
        ref_logits, ref_tokens = model_reference(hf, prompt, STEPS)
        logits, tokens = loaded_greedy(loaded, prompt, STEPS)
        diff = float(np.abs(logits - ref_logits).max())
        print(f"{case}: {len(prompt)}-token prompt, max-abs logit diff {diff:.3g}")
        assert diff <= TOL
        if prompt is prompts[-1]:  # (a short prompt's generation crosses the 32 positions: see LONG_PROMPTS)
            assert tokens == ref_tokens
    assert loaded.config["tie_word_embeddings"] == (CASES[case][0] in TIED)


@pytest.mark.parametrize("case", ["mixtral", "qwen3moe", "gemma3", "gpt-oss", "phi3"])
def test_quantized_file_loads_as_its_decoded_values(files, tmp_path, case):
    """A Q8_0 file (stacked experts, fused phi3 projections, permuted q/k rows all quantized) stays quantized and
    computes what the same file with its weights decoded to F32 computes."""
    hf_dir, _ = files(case)
    arch = CASES[case][0]
    q8 = convert(
        hf_dir, (tmp_path / "q8").mkdir() or tmp_path / "q8" / "m.gguf", arch, qtype=gguf.GGMLQuantizationType.Q8_0
    )
    f32 = convert(
        hf_dir,
        (tmp_path / "f32").mkdir() or tmp_path / "f32" / "m.gguf",
        arch,
        qtype=gguf.GGMLQuantizationType.Q8_0,
        dequantized=True,
    )
    quantized, decoded = load_model(str(q8), log=lambda m: None), load_model(str(f32), log=lambda m: None)
    kinds = {mlx_class_name(m) for _, m in quantized.model.named_modules()}
    assert "QuantizedLinear" in kinds and ("QuantizedSwitchLinear" in kinds) == (case != "gemma3" and case != "phi3")
    q_logits, q_tokens = loaded_greedy(quantized, PROMPT, STEPS)
    f_logits, f_tokens = loaded_greedy(decoded, PROMPT, STEPS)
    assert float(np.abs(q_logits - f_logits).max()) <= TOL
    assert q_tokens == f_tokens


@pytest.mark.parametrize("case", TRANSFORMERS_READS)
def test_transformers_reads_the_test_converter_output_as_the_checkpoint(files, case):
    """The test converter applies llama.cpp's changes the way transformers undoes them: independent evidence that
    the files above are what llama.cpp's converter writes."""
    hf_dir, path = files(case)
    hf = tf.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    from_gguf = tf.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        diff = (hf(ids).logits - from_gguf(ids).logits).abs().max().item()
    assert diff <= TOL, diff


def test_generate_cli_on_a_gguf_file(files):
    """`mlxcel generate -m file.gguf` gives transformers' greedy tokens on the original checkpoint."""
    hf_dir, path = files("qwen3moe")
    hf = tf.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert_generate_cli_gives_greedy(path, hf, STEPS)


def test_unsupported_architecture_is_one_line_naming_the_supported(files, tmp_path):
    from mlxcel_core.loading.gguf import gguf_config

    with pytest.raises(UnsupportedModelError) as err:
        gguf_config({"general.architecture": "rwkv7"}, {})
    message = str(err.value)
    assert "\n" not in message and "'rwkv7'" in message
    assert "llama" in message and "gemma3" in message and "qwen3moe" in message

    hf_dir, _ = files("llama")
    bad = convert(hf_dir, tmp_path / "bad.gguf", "llama", file_arch="bloom")
    result = CliRunner().invoke(app, ["generate", "-m", str(bad), "-p", "hi", "-n", "2"])
    assert result.exit_code == 2
    assert "GGUF architecture 'bloom' is not supported (supported: " in result.stderr
