"""GGUF deepseek2 (our deepseek_v3) and glm4moe (our glm4_moe): tiny transformers checkpoints converted the way
llama.cpp's converter does (tests/gguf_convert_mla.py: MLA declared as MQA over the latent, kv_b split into
attn_k_b / attn_v_b or kept whole in older files, YaRN's mscale as yarn_log_multiplier, stacked experts, the
selection bias as exp_probs_b, GLM4_MOE's MTP layer kept) must load through our GGUF loader and give transformers'
logits and greedy tokens on the original checkpoint; quantized files must compute what their decoded values do."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers as tf
from gguf_convert import convert
from gguf_convert_mla import convert_mla
from parity import (
    assert_generate_cli_gives_greedy,
    loaded_greedy,
    mlx_class_name,
    model_reference,
    prompt_ids,
    randomize_norms_and_biases,
)
from tiny_configs import DEEPSEEK_V3, GLM4_MOE, GLM4_MOE_VARIANTS
from tiny_models import save_tiny_checkpoint
from typer.testing import CliRunner

from mlxcel_cli.main import app
from mlxcel_core.errors import UnsupportedModelError
from mlxcel_core.loading import load_model
from mlxcel_core.loading.gguf import gguf_config, read_gguf

gguf = pytest.importorskip("gguf")

STEPS = 40
PROMPT = prompt_ids(12)
TOL = 2e-4  # F32 file, same weights: only summation order differs
# YaRN as llama.cpp reads it back: mscale equal to mscale_all_dim (DeepSeek-V2-Lite's 0.707 each; V3's 1.0 each).
YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=32,
    mscale=0.707,
    mscale_all_dim=0.707,
    beta_fast=32,
    beta_slow=1,
)
# id -> (GGUF architecture, config class, model class, config, checkpoint with an MTP layer)
CASES = {
    "deepseek-v3": (  # q LoRA, YaRN, 2 groups (best one kept), renormalized top-2 x 2.5, a shared expert
        "deepseek2",
        tf.DeepseekV3Config,
        tf.DeepseekV3ForCausalLM,
        dict(
            DEEPSEEK_V3,
            q_lora_rank=32,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            n_shared_experts=1,
            max_position_embeddings=128,
            rope_parameters=YARN,
        ),
        True,
    ),
    "moonlight": (  # q_proj (no q LoRA), plain RoPE, one group, 2 shared experts, tied, RMS epsilon 1e-5
        "deepseek2",
        tf.DeepseekV3Config,
        tf.DeepseekV3ForCausalLM,
        dict(
            DEEPSEEK_V3,
            q_lora_rank=None,
            num_experts_per_tok=3,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.446,
            norm_topk_prob=True,
            n_shared_experts=2,
            tie_word_embeddings=True,
            rms_norm_eps=1e-5,  # Moonlight's: the latent norms keep 1e-6
            max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
        ),
        False,
    ),
    "glm-4.5": (  # q/k norms, half the head rotated, 2 groups, the MTP layer kept in the file
        "glm4moe",
        tf.Glm4MoeConfig,
        tf.Glm4MoeForCausalLM,
        dict(GLM4_MOE, **GLM4_MOE_VARIANTS["glm-4.5"], max_position_embeddings=512),
        True,
    ),
    "glm-4.5-air": (  # no q/k norms, raw sigmoid weights, 2 dense layers, 8 of 32 dims rotated, tied, no MTP
        "glm4moe",
        tf.Glm4MoeConfig,
        tf.Glm4MoeForCausalLM,
        dict(GLM4_MOE, **GLM4_MOE_VARIANTS["air"], num_nextn_predict_layers=0, max_position_embeddings=512),
        False,
    ),
}
PRE = {"deepseek2": "deepseek-v3", "glm4moe": "glm4"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Per case: the HF checkpoint directory, built on first use."""
    built = {}

    def get(case):
        if case not in built:
            _, config_cls, model_cls, config, mtp = CASES[case]
            path = save_tiny_checkpoint(tmp_path_factory.mktemp(f"{case}-hf"), config_cls, model_cls, **config)
            built[case] = randomize_norms_and_biases(path, mtp_layer=config["num_hidden_layers"] if mtp else None)
        return built[case]

    return get


def _gguf(hf_dir, directory, case, **kwargs):
    arch = CASES[case][0]
    directory.mkdir(exist_ok=True)
    return convert_mla(hf_dir, directory / f"{case}.gguf", arch, pre=PRE[arch], **kwargs)


def _transformers(hf_dir):
    return tf.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()


def _assert_matches_transformers(hf_dir, path):
    ref_logits, ref_tokens = model_reference(_transformers(hf_dir), PROMPT, STEPS)
    loaded = load_model(str(path), log=lambda m: None)
    logits, tokens = loaded_greedy(loaded, PROMPT, STEPS)
    assert float(np.abs(logits - ref_logits).max()) <= TOL
    assert tokens == ref_tokens
    return loaded


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_matches_the_original_checkpoint(checkpoints, tmp_path, case):
    hf_dir = checkpoints(case)
    path = _gguf(hf_dir, tmp_path / "f32", case)
    loaded = _assert_matches_transformers(hf_dir, path)
    config, expected = loaded.config, CASES[case][3]
    assert config["num_hidden_layers"] == expected["num_hidden_layers"]  # glm4moe's block_count counts the MTP layer
    assert config["tie_word_embeddings"] == expected.get("tie_word_embeddings", False)
    if case == "deepseek-v3":
        _, meta = read_gguf(path)
        assert int(meta["deepseek2.attention.head_count_kv"]) == 1  # MQA over the latent, as llama.cpp declares it
        assert config["rope_scaling"]["mscale_all_dim"] == pytest.approx(0.707, rel=1e-6)


def test_older_deepseek2_file_with_attn_kv_b(checkpoints, tmp_path):
    """A file from before the kv_b split (attn_kv_b, per-head key/value lengths) loads too, F32 and Q8_0."""
    hf_dir = checkpoints("deepseek-v3")
    path = _gguf(hf_dir, tmp_path / "f32", "deepseek-v3", legacy=True)
    _, meta = read_gguf(path)
    assert "deepseek2.attention.key_length_mla" not in meta
    _assert_matches_transformers(hf_dir, path)
    q8 = _gguf(hf_dir, tmp_path / "q8", "deepseek-v3", legacy=True, qtype=gguf.GGMLQuantizationType.Q8_0)
    decoded = _gguf(
        hf_dir, tmp_path / "dq", "deepseek-v3", legacy=True, qtype=gguf.GGMLQuantizationType.Q8_0, dequantized=True
    )
    q_logits, q_tokens = loaded_greedy(load_model(str(q8), log=lambda m: None), PROMPT, STEPS)
    f_logits, f_tokens = loaded_greedy(load_model(str(decoded), log=lambda m: None), PROMPT, STEPS)
    assert float(np.abs(q_logits - f_logits).max()) <= TOL
    assert q_tokens == f_tokens


@pytest.mark.parametrize("case", ["deepseek-v3", "glm-4.5"])
def test_quantized_file_loads_as_its_decoded_values(checkpoints, tmp_path, case):
    """A Q8_0 file (attn_k_b / attn_v_b, stacked and shared experts quantized; the router in float) stays
    quantized and computes what the same file with its weights decoded to F32 computes."""
    hf_dir = checkpoints(case)
    q8 = _gguf(hf_dir, tmp_path / "q8", case, qtype=gguf.GGMLQuantizationType.Q8_0)
    decoded = _gguf(hf_dir, tmp_path / "dq", case, qtype=gguf.GGMLQuantizationType.Q8_0, dequantized=True)
    quantized = load_model(str(q8), log=lambda m: None)
    kinds = {mlx_class_name(m) for _, m in quantized.model.named_modules()}
    assert {"QuantizedLinear", "QuantizedSwitchLinear"} <= kinds
    assert ("QuantizedMultiLinear" in kinds) == (case == "deepseek-v3")
    q_logits, q_tokens = loaded_greedy(quantized, PROMPT, STEPS)
    f_logits, f_tokens = loaded_greedy(load_model(str(decoded), log=lambda m: None), PROMPT, STEPS)
    assert float(np.abs(q_logits - f_logits).max()) <= TOL
    assert q_tokens == f_tokens


@pytest.mark.parametrize("case", ["deepseek-v3", "glm-4.5"])
def test_generate_cli_on_a_gguf_file(checkpoints, tmp_path, case):
    """`mlxcel generate -m file.gguf --json` gives transformers' greedy tokens on the original checkpoint."""
    hf_dir = checkpoints(case)
    path = convert(
        hf_dir, (tmp_path / "g").mkdir() or tmp_path / "g" / "m.gguf", CASES[case][0], pre=PRE[CASES[case][0]]
    )
    assert_generate_cli_gives_greedy(path, _transformers(hf_dir), STEPS)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"deepseek2.expert_gating_func": 1}, "GGUF deepseek2 with softmax expert gating is not supported"),
        ({"deepseek2.expert_gating_func": None}, "GGUF deepseek2 with softmax expert gating is not supported"),
    ],
)
def test_what_our_model_cannot_compute_is_refused(checkpoints, tmp_path, change, message):
    path = _gguf(checkpoints("moonlight"), tmp_path / "f32", "moonlight")
    tensors, meta = read_gguf(path)
    meta = {**meta, **change}
    with pytest.raises(UnsupportedModelError, match=message):
        gguf_config({k: v for k, v in meta.items() if v is not None}, tensors)


def test_cli_refuses_a_file_without_the_selection_bias(checkpoints, tmp_path):
    """exp_probs_b missing (routing DeepSeek-V3's way needs it): one line on stderr, exit 2."""
    hf_dir = checkpoints("glm-4.5")
    path = _gguf(hf_dir, tmp_path / "f32", "glm-4.5")
    reader = gguf.GGUFReader(path)
    stripped = tmp_path / "stripped.gguf"
    w = gguf.GGUFWriter(str(stripped), "glm4moe")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        w.add_key_value(field.name, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
    for t in reader.tensors:
        if not t.name.endswith("exp_probs_b.bias"):
            w.add_tensor(t.name, np.array(t.data).reshape([int(d) for d in reversed(t.shape)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    result = CliRunner().invoke(app, ["generate", "-m", str(stripped), "-p", "hi", "-n", "2"])
    assert result.exit_code == 2
    assert "has no exp_probs_b (the expert selection bias)" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def _split(pre_tokenizer, text: str) -> list[str]:
    return [piece for piece, _ in pre_tokenizer.pre_tokenize_str(text)]


def test_pre_tokenizers_split_as_the_models_own_tokenizers():
    """deepseek-v3 splits as DeepSeek-V3's tokenizer.json (three isolated splits), glm4 as GLM4_MOE-4.5's (Llama 3's
    regex, as transformers' GGUF reader has it)."""
    from tokenizers import Regex, pre_tokenizers
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    from mlxcel_core.loading.gguf_vocab import _bpe_pre_tokenizer

    def reference(patterns):
        splits = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in patterns]
        return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])

    deepseek_v3 = json.loads(  # DeepSeek-V3's tokenizer.json pre_tokenizer patterns, as that file spells them
        r"""["\\p{N}{1,3}", "[一-龥\u3040-ゟ゠-ヿ]+", "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+"""
        r"""|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"]"""
    )
    texts = [
        "Hello,world 12345 3.14159",
        "日本語のテキストとカタカナ 中文",
        "don't I'll  we've\t\ttabs\n\n\nend ",
        "a-b_c/d\\e (f) [g] {h} émoji 🙂👍🏽",
    ]
    for pre, patterns in (("deepseek-v3", deepseek_v3), ("glm4", [GGUF_PRE_TOKENIZER_SPLITS["llama-bpe"]])):
        ours, theirs = _bpe_pre_tokenizer(pre), reference(patterns)
        for text in texts:
            assert _split(ours, text) == _split(theirs, text), (pre, text)


@pytest.mark.parametrize(
    ("text", "pieces"),
    [  # what llama.cpp's unicode_regex_split_custom_kimi_k2 makes of each (walked through its code by hand)
        ("getUserName iPhone", ["getUserName", " iPhone"]),  # one letter run: no case split, unlike tiktoken's
        ("中文abc日本語のテキスト", ["中文", "abc", "日本語", "のテキスト"]),  # Han runs apart; kana are letters
        ("I'M we've DON'T", ["I'M", " we've", " DON'T"]),  # contractions in any case
        ("12345 a,b", ["123", "45", " a", ",b"]),
        ("x  \n\n y\t", ["x", "  \n\n", " y", "\t"]),
        ("你好！ok", ["你好", "！ok"]),  # a non-letter leads the letters after it
        ("e\u0301!", ["e", "\u0301!"]),  # a combining mark is not a letter for llama.cpp
    ],
)
def test_kimi_k2_pre_tokenizer_splits_as_llama_cpp(text, pieces):
    from tokenizers import decoders

    from mlxcel_core.loading.gguf_vocab import _bpe_pre_tokenizer

    byte_level = decoders.ByteLevel()
    assert [byte_level.decode([p]) for p in _split(_bpe_pre_tokenizer("kimi-k2"), text)] == pieces
