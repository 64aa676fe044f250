"""GGUF parity with transformers: F32/F16/Q8_0/Q4_0/Q4_1 llama files written here the way llama.cpp's
convert_hf_to_gguf.py writes them (q/k row permutation, gpt2 byte-level BPE metadata), then loaded by our
loader and by transformers from the SAME file."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
import torch
from parity import mlx_class_name
from tiny_models import save_tiny_llama

from mlxcel_core.api import stream_generate
from mlxcel_core.loading import load_model
from mlxcel_core.sampling import SamplingParams

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

PROMPT = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 200, 31]
STEPS = 16
TEXTS = ["The capital of France is Paris.", "numbers 0123456789 and 42", "héllo wörld 日本語"]
FILE_TYPES = {Q.F32: 0, Q.F16: 1, Q.Q4_0: 2, Q.Q4_1: 3, Q.Q8_0: 7}  # llama.cpp's LlamaFileType
# Max-abs logit difference allowed against transformers on the same file. Both sides see the same
# dequantized values: MLX keeps Q8_0/Q4_0/Q4_1 as affine groups of 32 (fp16 scale, and bias 0 / -8*scale / min,
# all exact in fp16) and on CPU computes in fp32; transformers dequantizes to fp32 dense weights. Only
# summation order differs: measured max-abs 1.5e-6..2.2e-6 for every type (logits ~O(1)), so one 1e-4 bound.
# (Quantization itself is real: Q4_0 vs F32 logits differ by ~0.8, Q8_0 by ~0.05, F16 by ~2e-3.)
TOL = {Q.F32: 1e-4, Q.F16: 1e-4, Q.Q8_0: 1e-4, Q.Q4_0: 1e-4, Q.Q4_1: 1e-4}
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: interleave the two rotate-half halves of each head's rows."""
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _gguf_name(hf_name: str) -> str:
    stem = hf_name.removesuffix(".weight")
    if stem in TOP_NAMES:
        return f"{TOP_NAMES[stem]}.weight"
    _, _, layer, part = stem.split(".", 3)  # model.layers.N.<part>
    return f"blk.{layer}.{LAYER_NAMES[part]}.weight"


def write_gguf(hf_dir, out_path, qtype, permute: bool = True):
    """Convert a tiny HF llama checkpoint to a llama.cpp-style GGUF file with 2-D weights stored as `qtype`."""
    from safetensors.numpy import load_file
    from tokenizers import Tokenizer

    cfg = json.loads((hf_dir / "config.json").read_text())
    tok_cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    tok_json = json.loads((hf_dir / "tokenizer.json").read_text())
    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))

    w = gguf.GGUFWriter(str(out_path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(rope_theta)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(FILE_TYPES[qtype])

    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    special = {a["content"] for a in tok_json["added_tokens"] if a["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok_json["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")  # plain GPT-2 ByteLevel split: both loaders map "default" to it
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])  # 3 = CONTROL, 1 = NORMAL
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab["<|endoftext|>"])
    w.add_eos_token_id(vocab[tok_cfg["eos_token"]])
    w.add_add_bos_token(False)
    w.add_chat_template(tok_cfg["chat_template"])

    for name, arr in load_file(str(hf_dir / "model.safetensors")).items():
        arr, gname = arr.astype(np.float32), _gguf_name(name)
        if permute and ".attn_q." in gname:
            arr = _permute(arr, heads)
        elif permute and ".attn_k." in gname:
            arr = _permute(arr, kv_heads)
        if arr.ndim != 2 or qtype == Q.F32:  # norms stay F32, as llama.cpp keeps 1-D tensors
            w.add_tensor(gname, arr)
        elif qtype == Q.F16:
            w.add_tensor(gname, arr.astype(np.float16))
        else:
            w.add_tensor(gname, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-hf"))


def _gguf_file(tmp_path_factory, hf_dir, qtype, permute=True):
    # Its own directory, so transformers cannot pick up the HF config.json / tokenizer.json instead.
    out = tmp_path_factory.mktemp(f"gguf-{qtype.name}") / f"tiny-{qtype.name}.gguf"
    return write_gguf(hf_dir, out, qtype, permute=permute)


def _transformers(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        logits = model(ids).logits[0].float().numpy()
        out = model.generate(
            ids, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return logits, out[0, len(PROMPT) :].tolist(), tok


def _ours(path):
    loaded = load_model(str(path), log=lambda m: None)
    logits = np.array(loaded.model(mx.array([PROMPT])).astype(mx.float32))[0]
    loaded.tokenizer.eos_token_ids = set()  # random weights: compare all STEPS tokens
    tokens = [c.token for c in stream_generate(loaded, PROMPT, SamplingParams(max_tokens=STEPS)) if c.token is not None]
    return logits, tokens, loaded


@pytest.mark.parametrize("qtype", list(TOL), ids=lambda q: q.name)
def test_gguf_matches_transformers_on_same_file(tmp_path_factory, hf_dir, qtype):
    path = _gguf_file(tmp_path_factory, hf_dir, qtype)
    ref_logits, ref_tokens, ref_tok = _transformers(path)
    logits, tokens, loaded = _ours(path)

    diff_all = float(np.abs(logits - ref_logits).max())
    diff_last = float(np.abs(logits[-1] - ref_logits[-1]).max())
    print(f"{qtype.name}: max-abs logit diff all={diff_all:.3g} last={diff_last:.3g}")
    assert diff_last <= TOL[qtype] and diff_all <= TOL[qtype]
    assert tokens == ref_tokens

    kinds = {mlx_class_name(m) for _, m in loaded.model.named_modules()}
    quantized = qtype not in (Q.F32, Q.F16)
    assert ({"QuantizedLinear", "QuantizedEmbedding"} <= kinds) == quantized, kinds  # kept packed, not dequantized
    assert loaded.config["num_key_value_heads"] == 2 and loaded.config["tie_word_embeddings"] is False
    assert loaded.tokenizer.eos_token == "<|im_end|>" and loaded.tokenizer.chat_template.startswith("{% for")
    from tokenizers import Tokenizer

    hf_tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    for text in TEXTS + ["<|im_start|>user\nhi<|im_end|>"]:
        ours = loaded.tokenizer.encode(text, add_special_tokens=False)
        assert ours == ref_tok.encode(text, add_special_tokens=False), text
        assert ours == hf_tok.encode(text, add_special_tokens=False).ids, text
        assert loaded.tokenizer.backend.decode(ours, skip_special_tokens=False) == text


def test_unpermute_is_exercised(tmp_path_factory, hf_dir):
    """The F32 file reproduces the HF checkpoint in transformers; a file whose q/k rows were NOT permuted
    must then come out wrong through our loader, which proves the loader's unpermute really runs."""
    from transformers import AutoModelForCausalLM

    good = _gguf_file(tmp_path_factory, hf_dir, Q.F32)
    ref_logits, _, _ = _transformers(good)
    with torch.no_grad():
        hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        hf_logits = hf_model(torch.tensor([PROMPT])).logits[0].numpy()
    assert np.abs(ref_logits - hf_logits).max() <= 1e-4  # the writer's permutation is llama.cpp's

    good_logits = np.array(load_model(str(good), log=lambda m: None).model(mx.array([PROMPT])))[0]
    assert np.abs(good_logits - ref_logits).max() <= 1e-4
    bad = _gguf_file(tmp_path_factory, hf_dir, Q.F32, permute=False)
    bad_logits = np.array(load_model(str(bad), log=lambda m: None).model(mx.array([PROMPT])))[0]
    diff = float(np.abs(bad_logits - ref_logits).max())
    print(f"unpermuted F32 file: max-abs logit diff {diff:.3g}")
    assert diff > 1e-3
