"""GGUF hybrid recurrent families (qwen3next, qwen35, qwen35moe, lfm2): a tiny transformers checkpoint converted the
way llama.cpp's converter does (tests/gguf_convert_hybrid.py: -exp(A_log), dt_bias renamed, squeezed convolutions,
+1 norms, Qwen3-Next's split in_proj_qkvz, Qwen3.5's tiled value heads, LFM2's per-layer KV heads) loads into the
same model and gives transformers' logits and greedy tokens, through the API and `mlxcel generate -m FILE.gguf`."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers as tf
from gguf_convert import convert
from gguf_convert_hybrid import convert_hybrid
from parity import loaded_greedy, mlx_class_name, prompt_ids
from tiny_configs import LFM2
from tiny_models import save_tiny_checkpoint
from typer.testing import CliRunner

from mlxcel_cli.main import app
from mlxcel_core.errors import UnsupportedModelError
from mlxcel_core.loading import load_model

gguf = pytest.importorskip("gguf")

STEPS = 40
PROMPT = prompt_ids(12)
TOL = 2e-4  # F32 file, same weights: summation order and exp/log of A_log differ
# Two key heads, four value heads (Qwen3.5's value-head reorder applies), value heads of 32 (whole Q8_0 groups).
DELTA_NET = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    initializer_range=0.1,
    layer_types=["linear_attention", "full_attention"] * 2,
)
# The MoE cases: one delta-net and one attention layer (their MLPs are the slow part of transformers' forward).
MOE_LAYERS = dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
MOE = dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64, **MOE_LAYERS
)
ROPE = {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}
MODEL_TYPES = {
    "qwen3next": "qwen3_next",
    "qwen35": "qwen3_5",
    "qwen35moe": "qwen3_5_moe",
    "lfm2": "lfm2",
    "nemotron_h": "nemotron_h",
}
ARCH_CASES = list(MODEL_TYPES)  # one case per architecture
# id -> (GGUF architecture, config class, model class, config, tokenizer.ggml.pre)
CASES = {
    "qwen3next": (
        "qwen3next",
        tf.Qwen3NextConfig,
        tf.Qwen3NextForCausalLM,
        dict(**{**DELTA_NET, **MOE}, intermediate_size=64, mlp_only_layers=[], rope_parameters=ROPE),
        "qwen2",
    ),
    "qwen35": (
        "qwen35",
        tf.Qwen3_5TextConfig,
        tf.Qwen3_5ForCausalLM,
        dict(**DELTA_NET, intermediate_size=96, rope_parameters={**ROPE, "mrope_section": [4, 2, 2]}),
        "qwen35",
    ),
    "qwen35moe": (
        "qwen35moe",
        tf.Qwen3_5MoeTextConfig,
        tf.Qwen3_5MoeForCausalLM,
        dict(**{**DELTA_NET, **MOE}, rope_parameters={**ROPE, "mrope_section": [4, 2, 2]}),
        "qwen35",
    ),
    # Value heads of 16, half a Q8_0 group: a quantized out_proj's reordered columns cannot stay quantized.
    "qwen35-dv16": (
        "qwen35",
        tf.Qwen3_5TextConfig,
        tf.Qwen3_5ForCausalLM,
        dict(**{**DELTA_NET, **MOE_LAYERS, "linear_value_head_dim": 16}, intermediate_size=96, rope_parameters=ROPE),
        "qwen35",
    ),
    # Layers: conv, conv, attention, conv; feed-forward width int(2 * 100 / 3) = 66, times 1.5 = 99, rounded up to
    # 128; no convolution biases and the LM head tied to the embedding, as the released checkpoints (the converter
    # squeezes every `conv.conv` tensor, which a bias does not survive).
    "lfm2": (
        "lfm2",
        tf.Lfm2Config,
        tf.Lfm2ForCausalLM,
        {**LFM2, "conv_bias": False, "tie_word_embeddings": True},  # (test_lfm2's, as released checkpoints)
        "lfm2",
    ),
    # Blocks: Mamba2, attention, MLP (tests/recurrent_tiny.py's), time_step_limit at transformers' default: the file
    # does not carry it.
    "nemotron_h": (
        "nemotron_h",
        tf.NemotronHConfig,
        tf.NemotronHForCausalLM,
        dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            initializer_range=0.1,
            intermediate_size=96,
            layers_block_type=["linear_attention", "full_attention", "mlp"],
            head_dim=16,
            mamba_num_heads=8,
            mamba_head_dim=8,
            n_groups=2,
            ssm_state_size=16,
            conv_kernel=4,
            chunk_size=16,
            tie_word_embeddings=False,
        ),
        "default",
    ),
}


def _condition(path, seed: int = 0):
    """Random values where transformers initializes constants (norms, decays, dt_bias), so that each conversion is
    read, at scales where float32 noise stays small (tests/mlxcel_core/models/test_qwen3_next.py's condition)."""
    from safetensors.numpy import load_file, save_file

    weights = load_file(path / "model.safetensors")
    rng = np.random.default_rng(seed)
    for name, w in weights.items():
        if name.endswith("linear_attn.norm.weight") or name.endswith(("operator_norm.weight", "ffn_norm.weight")):
            weights[name] = rng.uniform(0.5, 1.5, w.shape).astype(w.dtype)
        elif name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            low = -0.5 if "qwen" in path.name else 0.5  # Qwen's norms scale by (1 + weight), the others by weight
            weights[name] = rng.uniform(low, low + 1.0, w.shape).astype(w.dtype)
        elif name.endswith("A_log"):
            weights[name] = np.log(rng.uniform(0.5, 4.0, w.shape)).astype(w.dtype)
        elif name.endswith(".D"):
            weights[name] = rng.uniform(0.5, 1.5, w.shape).astype(w.dtype)
        elif name.endswith("dt_bias"):
            weights[name] = rng.uniform(-1.0, 1.0, w.shape).astype(w.dtype)
        elif name.endswith("conv1d.weight"):
            weights[name] = (w * 4.0).astype(w.dtype)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    built = {}

    def get(case):
        if case not in built:
            _, config_cls, model_cls, config, _ = CASES[case]
            path = tmp_path_factory.mktemp("hf") / case
            built[case] = _condition(
                save_tiny_checkpoint(path, config_cls, model_cls, max_position_embeddings=512, **config)
            )
        return built[case]

    return get


def _gguf(hf_dir, directory, case, **kwargs):
    arch, *_, pre = CASES[case]
    directory.mkdir(exist_ok=True)
    return convert(hf_dir, directory / f"{case}.gguf", arch, pre=pre, **kwargs)


def _greedy(hf, ids: list[int], suppress: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]),
            max_new_tokens=STEPS,
            min_new_tokens=STEPS,
            do_sample=False,
            pad_token_id=0,
            suppress_tokens=suppress,
        )
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("case", ARCH_CASES)
def test_gguf_matches_the_original_checkpoint(checkpoints, tmp_path, case):
    """`mlxcel generate -m FILE.gguf` gives transformers' 40 greedy tokens on the checkpoint (end-of-generation
    tokens suppressed on both sides, so that all 40 count), and the loaded model its logits."""
    hf_dir = checkpoints(case)
    path = _gguf(hf_dir, tmp_path / "f32", case)
    hf = tf.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    loaded = load_model(str(path), log=lambda m: None)
    assert loaded.config["model_type"] == MODEL_TYPES[case]
    prompt = "The capital of France is"
    ids = loaded.tokenizer.encode(prompt)
    with torch.no_grad():
        ref_logits = hf(torch.tensor([ids])).logits[0].float().numpy()
    logits = np.array(loaded.model(mx.array([ids])).astype(mx.float32))[0]
    diff = float(np.abs(logits - ref_logits).max())
    print(f"{case}: max-abs logit diff {diff:.3g}")
    assert diff <= TOL

    eos = sorted(loaded.tokenizer.eos_token_ids)
    suppress = [arg for t in eos for arg in ("--suppress-token", str(t))]
    result = CliRunner().invoke(
        app, ["generate", "-m", str(path), "-p", prompt, "-n", str(STEPS), "--no-chat-template", "--json", *suppress]
    )
    assert result.exit_code == 0, result.output
    tokens = json.loads(result.stdout)["token_ids"]
    assert len(tokens) == STEPS and tokens == _greedy(hf, ids, eos)


@pytest.mark.parametrize("case", list(CASES))
def test_quantized_file_loads_as_its_decoded_values(checkpoints, tmp_path, case):
    """A Q8_0 file stays quantized (Qwen3-Next's merged in_proj_qkvz, Qwen3.5's reordered value heads and out_proj
    columns included; out_proj in float where its value heads are not whole groups) and computes what the same
    file with its weights decoded to F32 computes."""
    hf_dir = checkpoints(case)
    q8 = _gguf(hf_dir, tmp_path / "q8", case, qtype=gguf.GGMLQuantizationType.Q8_0)
    f32 = _gguf(hf_dir, tmp_path / "f32", case, qtype=gguf.GGMLQuantizationType.Q8_0, dequantized=True)
    quantized, decoded = load_model(str(q8), log=lambda m: None), load_model(str(f32), log=lambda m: None)
    kinds = {name: mlx_class_name(m) for name, m in quantized.model.named_modules()}
    layer0 = {"lfm2": "model.layers.0.conv", "nemotron_h": "model.layers.0.mixer"}.get(
        case, "model.layers.0.linear_attn"
    )
    projections = {
        "lfm2": ["in_proj", "out_proj"],
        "nemotron_h": ["in_proj", "out_proj"],
        "qwen3next": ["in_proj_qkvz", "in_proj_ba", "out_proj"],
    }
    for name in projections.get(case, ["in_proj_qkv", "in_proj_z", "in_proj_a", "out_proj"]):
        expected = "Linear" if case == "qwen35-dv16" and name == "out_proj" else "QuantizedLinear"
        assert kinds[f"{layer0}.{name}"] == expected, name
    assert ("QuantizedSwitchLinear" in kinds.values()) == ("moe" in case or case == "qwen3next")
    q_logits, q_tokens = loaded_greedy(quantized, PROMPT, STEPS)
    f_logits, f_tokens = loaded_greedy(decoded, PROMPT, STEPS)
    assert float(np.abs(q_logits - f_logits).max()) <= TOL
    assert q_tokens == f_tokens


def test_qwen3next_file_with_the_older_fused_projection(checkpoints, tmp_path):
    """Older converters kept Qwen3-Next's in_proj_qkvz whole (`ssm_in`); llama.cpp still loads such files."""
    hf_dir = checkpoints("qwen3next")
    path = convert_hybrid(
        hf_dir, tmp_path / "legacy.gguf", "qwen3next", "tiny", "qwen2", None, None, False, legacy=True
    )
    names = {t.name for t in gguf.GGUFReader(path).tensors}  # ssm_in, not attn_qkv / attn_gate
    assert "blk.0.ssm_in.weight" in names and "blk.0.attn_qkv.weight" not in names
    hf = tf.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float().numpy()
    logits = np.array(load_model(str(path), log=lambda m: None).model(mx.array([PROMPT])).astype(mx.float32))[0]
    assert float(np.abs(logits - ref).max()) <= TOL


def test_qwen35_file_with_a_multi_token_prediction_block(checkpoints, tmp_path):
    """A Qwen3.5 file with its MTP block after the decoder layers (block_count counts it) loads the decoder alone."""
    hf_dir = checkpoints("qwen35")
    path = convert_hybrid(hf_dir, tmp_path / "mtp.gguf", "qwen35", "tiny", "qwen35", None, None, False, mtp=True)
    layers = CASES["qwen35"][3]["num_hidden_layers"]
    assert f"blk.{layers}.nextn.eh_proj.weight" in {t.name for t in gguf.GGUFReader(path).tensors}
    loaded = load_model(str(path), log=lambda m: None)
    assert loaded.config["num_hidden_layers"] == len(loaded.model.layers) == layers
    hf = tf.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float().numpy()
    logits = np.array(loaded.model(mx.array([PROMPT])).astype(mx.float32))[0]
    assert float(np.abs(logits - ref).max()) <= TOL


def test_a_qwen35_file_with_experts_is_refused():
    from mlxcel_core.loading.gguf import gguf_config

    meta = {
        "general.architecture": "qwen35",
        "qwen35.embedding_length": 64,
        "qwen35.block_count": 1,
        "qwen35.attention.head_count": 4,
        "qwen35.ssm.conv_kernel": 4,
        "qwen35.ssm.state_size": 16,
        "qwen35.ssm.group_count": 2,
        "qwen35.ssm.time_step_rank": 4,
        "qwen35.ssm.inner_size": 64,
        "qwen35.expert_count": 4,
    }
    with pytest.raises(UnsupportedModelError, match="qwen35 with experts is not supported"):
        gguf_config(meta, {})
