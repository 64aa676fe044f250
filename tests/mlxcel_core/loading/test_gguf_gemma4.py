"""GGUF architectures gemma4, llama4 and mistral3: a tiny transformers checkpoint of each family, converted the way
llama.cpp's converter does (tests/gguf_convert_gemma4.py), loads through our GGUF loader into gemma4_text /
llama4_text / ministral3 and gives transformers' logits and greedy tokens on the original checkpoint -- through the
API and `mlxcel generate -m FILE.gguf --json`; a Q8_0 file computes what its decoded F32 twin computes; what the
models cannot do from a file is refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers as tf
from gguf_convert import convert
from parity import assert_generate_cli_gives_greedy, loaded_greedy, mlx_class_name, prompt_ids, reference
from tiny_configs import GEMMA4_DENSE, GEMMA4_MOE, F, S
from tiny_models import save_tiny_checkpoint

from mlxcel_core.errors import UnsupportedModelError
from mlxcel_core.loading import load_model
from mlxcel_core.loading.gguf import gguf_config

gguf = pytest.importorskip("gguf")

STEPS = 40
PROMPT = prompt_ids(12)
TOL = 2e-4
COMMON = dict(max_position_embeddings=512, initializer_range=0.1, eos_token_id=2, bos_token_id=None, pad_token_id=0)
# llama.cpp fixes llama4's chunk (8192), NoPE period (4) and temperature tuning (8192, 0.1): the checkpoint has them.
LLAMA4 = dict(
    hidden_size=64,
    intermediate_size=64,
    intermediate_size_mlp=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    attention_chunk_size=8192,
    no_rope_layer_interval=4,
    num_local_experts=4,
    num_experts_per_tok=1,
    interleave_moe_layer_step=2,
    attn_temperature_tuning=True,
    floor_scale=8192,
    attn_scale=0.1,
    use_qk_norm=True,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)
# YaRN over 16 original positions and the query scaling's beta: a 52-token run crosses both.
MINISTRAL3 = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "llama_4_scaling_beta": 0.5,
    },
)
# id -> (GGUF architecture, our model_type, config class, model class, config)
CASES = {
    "gemma4": ("gemma4", "gemma4_text", tf.Gemma4TextConfig, tf.Gemma4ForCausalLM, GEMMA4_DENSE),
    "gemma4-moe": ("gemma4", "gemma4_text", tf.Gemma4TextConfig, tf.Gemma4ForCausalLM, GEMMA4_MOE),
    "llama4": ("llama4", "llama4_text", tf.Llama4TextConfig, tf.Llama4ForCausalLM, LLAMA4),
    "ministral3": ("mistral3", "ministral3", tf.Ministral3Config, tf.Ministral3ForCausalLM, MINISTRAL3),
}
RANDOM = ("norm.weight", "layer_scalar", "router.scale", "per_expert_scale")  # ones in transformers' init


def randomize(path):
    """Norm gains, layer scalars and router scales in [0.5, 1.5) (a missed or extra +1 shows); Gemma 4's q/k norm
    gains halved (its attention is unscaled over normed q and k: ones would make it too peaked to compare)."""
    from safetensors.numpy import load_file, save_file

    weights = load_file(path / "model.safetensors")
    rng = np.random.default_rng(1)
    for name, w in weights.items():
        if name.endswith(RANDOM):
            w = rng.uniform(0.5, 1.5, size=w.shape).astype(w.dtype)
            gemma_qk = "q_norm" in name or "k_norm" in name
            weights[name] = (w * 0.5).astype(w.dtype) if gemma_qk and "layer_scalar" not in name else w
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Per case: (HF checkpoint dir, F32 GGUF path), built on first use."""
    built = {}

    def get(case):
        if case not in built:
            arch, _, config_cls, model_cls, extra = CASES[case]
            hf_dir = save_tiny_checkpoint(
                tmp_path_factory.mktemp(f"{case}-hf"), config_cls, model_cls, **COMMON, **extra
            )
            randomize(hf_dir)
            path = convert(hf_dir, tmp_path_factory.mktemp(f"{case}-gguf") / f"{case}.gguf", arch)
            built[case] = (hf_dir, path)
        return built[case]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_matches_the_original_checkpoint(files, case):
    hf_dir, path = files(case)
    loaded = load_model(str(path), log=lambda m: None)
    assert loaded.config["model_type"] == CASES[case][1]
    ref_logits, ref_tokens = reference(hf_dir, PROMPT, STEPS)
    logits, tokens = loaded_greedy(loaded, PROMPT, STEPS)
    diff = float(np.abs(logits - ref_logits).max())
    print(f"{case}: max-abs logit diff {diff:.3g}")
    assert diff <= TOL
    assert tokens == ref_tokens


def test_gemma4_config_from_the_metadata(files):
    """The metadata's per-layer arrays and the rope factors become the checkpoint's geometry."""
    dense = load_model(str(files("gemma4")[1]), log=lambda m: None).model.args
    assert dense.layer_shapes == [(32, 2), (64, 2), (32, 2), (32, 2), (64, 2)]
    assert dense.kv_sources == [0, 1, 2, 2, 1] and dense.use_double_wide_mlp
    assert dense.rope_parameters[F] == {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1e4}
    assert dense.rope_parameters[S] == {"rope_type": "default", "rope_theta": 100.0}
    moe = load_model(str(files("gemma4-moe")[1]), log=lambda m: None).model.args
    assert moe.layer_shapes == [(32, 2), (32, 2), (64, 1)] and moe.attention_k_eq_v and moe.enable_moe_block


@pytest.mark.parametrize("case", list(CASES))
def test_quantized_file_loads_as_its_decoded_values(files, tmp_path, case):
    """A Q8_0 file (gemma4's per-layer embedding projection and fused experts split at load, llama4's expert banks,
    mistral3's permuted q/k rows all quantized; rows shorter than a block stay F32, as llama-quantize keeps them)
    stays quantized and computes what the same file with its weights decoded to F32 computes."""
    hf_dir, _ = files(case)
    arch, q8 = CASES[case][0], gguf.GGMLQuantizationType.Q8_0
    quantized = load_model(str(convert(hf_dir, tmp_path / "q8.gguf", arch, qtype=q8)), log=lambda m: None)
    decoded = load_model(
        str(convert(hf_dir, tmp_path / "f32.gguf", arch, qtype=q8, dequantized=True)), log=lambda m: None
    )
    kinds = {mlx_class_name(m) for _, m in quantized.model.named_modules()}
    assert "QuantizedLinear" in kinds and ("QuantizedSwitchLinear" in kinds) == (case in ("gemma4-moe", "llama4"))
    q_logits, q_tokens = loaded_greedy(quantized, PROMPT, STEPS)
    f_logits, f_tokens = loaded_greedy(decoded, PROMPT, STEPS)
    assert float(np.abs(q_logits - f_logits).max()) <= TOL
    assert q_tokens == f_tokens


@pytest.mark.parametrize("case", ["gemma4", "llama4", "ministral3"])
def test_generate_cli_on_a_gguf_file(files, case):
    """`mlxcel generate -m file.gguf --json` gives transformers' greedy tokens on the original checkpoint."""
    hf_dir, path = files(case)
    hf = tf.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    assert_generate_cli_gives_greedy(path, hf, STEPS)


def _meta(arch: str, **keys) -> dict:
    base = {
        "general.architecture": arch,
        "tokenizer.ggml.tokens": ["a"] * 8,
        f"{arch}.embedding_length": 64,
        f"{arch}.block_count": 2,
        f"{arch}.attention.head_count": 4,
        f"{arch}.feed_forward_length": 128,
    }
    return {**base, **{f"{arch}.{k.replace('__', '.')}": v for k, v in keys.items()}}


GEMMA4_KEYS = dict(
    attention__key_length=64,
    attention__key_length_swa=32,
    attention__sliding_window=8,
    attention__sliding_window_pattern=[True, False],
    embedding_length_per_layer_input=0,
)
GEMMA4_NAMES = {"blk.0.attn_v.weight", "blk.1.attn_v.weight"}


@pytest.mark.parametrize(
    "meta, names, message",
    [
        (_meta("gemma4", **GEMMA4_KEYS), {"blk.1.attn_v.weight"}, "sliding layers without attn_v"),
        (
            _meta("gemma4", **GEMMA4_KEYS, rope__dimension_count_swa=16),
            GEMMA4_NAMES,
            "partial rotary embedding (16 of 32 dims",
        ),
        (
            _meta("gemma4", **GEMMA4_KEYS, feed_forward_length=[128, 96]),
            GEMMA4_NAMES,
            "per-layer feed-forward lengths [128, 96]",
        ),
        (_meta("llama4", attention__sliding_window=0), set(), "without chunked attention (sliding_window 0)"),
        (_meta("mistral3", expert_count=4, expert_used_count=2), set(), "mistral3 with experts"),
    ],
)
def test_what_the_models_cannot_do_is_refused_by_name(meta, names, message):
    with pytest.raises(UnsupportedModelError) as err:
        gguf_config(meta, {n: None for n in names})
    assert message in str(err.value) and "\n" not in str(err.value)


def test_gemma4_rope_factors_other_than_proportional_are_refused(files, tmp_path):
    """A rope_freqs tensor that is not proportional RoPE's (1, then 1e30) would rotate otherwise: refused."""
    from mlxcel_core.loading.gguf_gemma4 import gemma4_fixup

    config = {"global_head_dim": 8, "num_hidden_layers": 0, "enable_moe_block": False}
    config["rope_parameters"] = {F: {"rope_type": "proportional"}}
    config["rope_scaling"] = {"short_factor": [1.0, 2.0, 1e30, 1e30]}
    with pytest.raises(UnsupportedModelError, match="rope_freqs other than proportional"):
        gemma4_fixup({}, config)
    config["rope_scaling"] = {"short_factor": [1.0, 1.0, 1e30, 1e30]}
    gemma4_fixup({}, config)
    assert config["rope_parameters"][F]["partial_rotary_factor"] == 0.5


def test_supported_list_names_the_new_architectures():
    with pytest.raises(UnsupportedModelError) as err:
        gguf_config({"general.architecture": "rwkv7"}, {})
    assert all(f"{arch}" in str(err.value) for arch in ("gemma4", "llama4", "mistral3"))


def _llama_cpp_gemma4_encode(text: str, tokens: list[str], merges: list[str]) -> list[int]:
    """llama.cpp's gemma4 BPE session, written out: spaces as U+2581, runs of newlines and of other characters,
    a newline run that is a token kept whole, merges by rank (leftmost first), <0xNN> for what is left unknown."""
    import re

    ids = {t: i for i, t in enumerate(tokens)}
    ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(merges)}
    out = []
    for word in re.findall(r"[^\n]+|\n+", text.replace(" ", "\u2581")):
        if not word.strip("\n") and word in ids:
            out.append(ids[word])
            continue
        symbols = list(word)
        while True:
            pairs = [(ranks.get((a, b)), i) for i, (a, b) in enumerate(zip(symbols, symbols[1:]))]
            pairs = [p for p in pairs if p[0] is not None]
            if not pairs:
                break
            _, i = min(pairs)
            symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
        for s in symbols:
            out.extend([ids[s]] if s in ids else [ids[f"<0x{b:02X}>"] for b in s.encode()])
    return out


def test_gemma4_tokenizer_encodes_as_llama_cpp():
    """A `gemma4` vocabulary (BPE trained on ▁-escaped text, byte tokens, newline-run tokens no merge makes, control
    and user-defined tokens) encodes as llama.cpp's gemma4 session and decodes back to the text."""
    from tokenizers import Regex, models, normalizers, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer

    from mlxcel_core.loading.gguf_vocab import gguf_tokenizer

    corpus = ["The capital of France is Paris.", "Hello world, hello tokens!", "naïve café 東京", "a  b   c"] * 20
    trainer_tok = HFTokenizer(models.BPE())
    trainer_tok.normalizer = normalizers.Replace(" ", "\u2581")
    trainer_tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
    trainer_tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=150, show_progress=False))
    model = json.loads(trainer_tok.to_str())["model"]
    learned = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    special = ["<pad>", "<eos>", "<bos>", "<turn|>", "<|channel>"]
    tokens = special + [f"<0x{b:02X}>" for b in range(256)] + ["\n", "\n\n", "\n\n\n"] + learned
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [3, 3, 3, 3, 4] + [6] * 256 + [1] * (len(tokens) - 261)
    meta = {
        "general.architecture": "gemma4",
        "tokenizer.ggml.model": "gemma4",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.add_bos_token": True,
    }
    tok = gguf_tokenizer(meta)
    texts = ["The capital of France is", "hello\n\nworld\n\n\nend\n", "  naïve 東京 ok", "Zebra ✓ qx", "x\ny"]
    for text in texts:
        expected = _llama_cpp_gemma4_encode(text, tokens, merges)
        assert tok.encode(text) == [2, *expected], text
        assert tok.decode(expected) == text
    assert tok.encode("<turn|>hi<|channel>")[:2] == [2, 3] and 4 in tok.encode("<turn|>hi<|channel>")
    assert {1, 3} <= tok.eos_token_ids


def test_llama4_and_mistral3_values_llama_cpp_fixes_or_derives():
    """llama4: the q/k norm off for 128 experts (Maverick), llama.cpp's fixed chunk and temperature tuning, a
    sliding_window_pattern period for the chunked layers; mistral3 without YaRN: the query scaling's length is the
    training context."""
    llama4 = _meta(
        "llama4",
        expert_count=128,
        expert_used_count=1,
        expert_feed_forward_length=32,
        interleave_moe_layer_step=1,
        attention__sliding_window_pattern=2,
    )
    config = gguf_config(llama4, {})
    assert config["use_qk_norm"] is False and config["num_local_experts"] == 128
    assert (config["attention_chunk_size"], config["floor_scale"], config["attn_scale"]) == (8192, 8192, 0.1)
    assert config["layer_types"] == ["chunked_attention", "full_attention"]
    assert (config["intermediate_size"], config["intermediate_size_mlp"]) == (32, 128)
    assert gguf_config({**llama4, "llama4.expert_count": 16}, {})["use_qk_norm"] is True
    mistral3 = gguf_config(_meta("mistral3", context_length=4096, attention__temperature_scale=0.1), {})
    assert mistral3["rope_parameters"] == {
        "rope_type": "default",
        "original_max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "llama_4_scaling_beta": 0.1,
    }
