"""GGUF tensor types onto MLX quantization, checked against ggml's own code: every type is encoded by a reference
quantizer (the gguf package's numpy port of ggml where it has one, else libgguf's native port of ggml's
quantize_row_* functions) and our decode is compared with gguf.quants.dequantize (ggml's reference
dequantization). Then tiny llama files of K-quants load and generate through the CLI exactly as the same weights
dequantized to F32, loading stays within 1.5x the file size, and bad files are one-line errors."""

from __future__ import annotations

import json
import tracemalloc

import gguf
import libgguf
import mlx.core as mx
import numpy as np
import pytest
from gguf.quants import dequantize
from parity import mlx_class_name
from tiny_models import CHATML, build_tokenizer

from mlxcel_cli.main import main
from mlxcel_core.loading import load_model
from mlxcel_core.loading.gguf_tensors import SUPPORTED_TYPES, QuantizedTensor, read_gguf_tensors

Q = gguf.GGMLQuantizationType
# The gguf package quantizes these itself; libgguf (ggml's quantizers compiled) the rest.
GGUF_QUANTIZES = {Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.MXFP4}
# type -> (bits, mode, exact) of the MLX layout it must arrive in.
LAYOUT = {
    Q.Q4_0: (4, "affine", True),
    Q.Q4_1: (4, "affine", True),
    Q.Q5_0: (5, "affine", True),
    Q.Q5_1: (5, "affine", True),
    Q.Q8_0: (8, "affine", True),
    Q.Q2_K: (4, "affine", False),
    Q.Q3_K: (8, "affine", True),
    Q.Q4_K: (4, "affine", True),
    Q.Q5_K: (5, "affine", True),
    Q.Q6_K: (8, "affine", False),
    Q.IQ4_NL: (8, "affine", True),
    Q.IQ4_XS: (8, "affine", True),
    Q.MXFP4: (4, "mxfp4", True),
}
FLOATS = (Q.F32, Q.F16, Q.BF16)
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2


def encode(x: np.ndarray, qtype) -> np.ndarray:
    """`x` (float32, last axis a multiple of 256) in ggml's bytes for `qtype` (F32/F16 as arrays)."""
    if qtype == Q.F32:
        return x
    if qtype == Q.F16:
        return x.astype(np.float16)
    if qtype in GGUF_QUANTIZES:
        return gguf.quants.quantize(x, qtype)
    rows = np.asarray(libgguf.quantize_rows(x.reshape(-1, x.shape[-1]), libgguf.GGMLQuantizationType[qtype.name]))
    return rows.reshape(*x.shape[:-1], -1)


def reference(raw: np.ndarray, qtype) -> np.ndarray:
    return raw.astype(np.float32) if qtype in (Q.F32, Q.F16) else dequantize(raw, qtype)


def write(path, tensors: dict[str, tuple[np.ndarray, object]], meta=None):
    """A GGUF file of `name -> (encoded data, type)`; `meta(writer)` adds key/values."""
    w = gguf.GGUFWriter(str(path), "llama")
    if meta is not None:
        meta(w)
    for name, (data, qtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def as_numpy(value) -> np.ndarray:
    array = value.dequantize() if isinstance(value, QuantizedTensor) else value
    return np.array(array.astype(mx.float32))


@pytest.mark.parametrize("qtype", [*FLOATS, *LAYOUT], ids=lambda q: q.name)
def test_type_matches_ggml_reference(tmp_path, qtype):
    rng = np.random.default_rng(int(qtype))
    x = (rng.standard_normal((2, 6, 512)) * rng.uniform(0.01, 4, (2, 6, 1))).astype(np.float32)  # experts-like 3-D
    y = rng.standard_normal((6, 256)).astype(np.float32)
    raws = {"a.weight": encode(x, qtype), "b.weight": encode(y, qtype)}
    tensors, _ = read_gguf_tensors(write(tmp_path / "t.gguf", {k: (v, qtype) for k, v in raws.items()}))
    assert set(tensors) == set(raws)
    for name, raw in raws.items():
        value, ref = tensors[name], reference(raw, qtype)
        ours = as_numpy(value)
        assert ours.shape == ref.shape
        if qtype in FLOATS:
            assert isinstance(value, mx.array) and np.array_equal(ours, ref), name
            continue
        bits, mode, exact = LAYOUT[qtype]
        assert (value.bits, value.group_size, value.mode, value.exact, value.source_type) == (
            bits,
            32,
            mode,
            exact,
            qtype.name,
        )
        if exact:
            assert np.array_equal(ours, ref), f"{name}: max diff {np.abs(ours - ref).max()}"
        else:  # requantized to round-to-nearest on a min-max grid: at most half a step off ggml's value
            half_step = np.repeat(np.abs(np.array(value.scales)), 32, axis=-1) / 2
            assert np.all(np.abs(ours - ref) <= half_step * (1 + 1e-3) + 1e-6), name
            assert not np.array_equal(ours, ref)
        # The layers compute with quantized_matmul on the packed tensor: the same values as the dense product.
        inputs = mx.array(rng.standard_normal((3, ref.shape[-1])).astype(np.float32))
        dense = inputs @ mx.array(ours.reshape(-1, ref.shape[-1])).T
        w = value.apply(lambda a: a.reshape(-1, a.shape[-1]))
        packed = mx.quantized_matmul(
            inputs, w.weight, w.scales, w.biases, transpose=True, group_size=32, bits=bits, mode=mode
        )
        assert np.allclose(np.array(packed), np.array(dense), rtol=1e-4, atol=1e-4)


def test_permute_rows_moves_weight_scales_and_biases_together(tmp_path):
    x = np.random.default_rng(1).standard_normal((8, 256)).astype(np.float32)
    raw = encode(x, Q.Q4_K)
    tensors, _ = read_gguf_tensors(write(tmp_path / "t.gguf", {"w.weight": (raw, Q.Q4_K)}))
    index = np.array([3, 1, 7, 0, 2, 6, 5, 4])
    assert np.array_equal(as_numpy(tensors["w.weight"].permute_rows(index)), reference(raw, Q.Q4_K)[index])


def test_unsupported_type_is_refused_naming_it_and_the_supported_ones(tmp_path):
    path = write(tmp_path / "t.gguf", {"w.weight": (np.zeros((4, 66), np.uint8), Q.IQ2_XXS)})
    with pytest.raises(Exception) as info:
        read_gguf_tensors(path)
    message = str(info.value)
    assert "w.weight" in message and "IQ2_XXS" in message and ", ".join(SUPPORTED_TYPES) in message


# --- tiny llama files ---------------------------------------------------------------------------------------------


def _llama_weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    vocab = build_tokenizer().get_vocab_size()
    head_dim = HIDDEN // HEADS

    def mat(rows, cols):
        return (rng.standard_normal((rows, cols)) * 0.08).astype(np.float32)

    def norm():
        return (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)

    out = {"token_embd.weight": mat(vocab, HIDDEN), "output_norm.weight": norm(), "output.weight": mat(vocab, HIDDEN)}
    for i in range(LAYERS):
        out |= {
            f"blk.{i}.attn_norm.weight": norm(),
            f"blk.{i}.attn_q.weight": mat(HEADS * head_dim, HIDDEN),
            f"blk.{i}.attn_k.weight": mat(KV_HEADS * head_dim, HIDDEN),
            f"blk.{i}.attn_v.weight": mat(KV_HEADS * head_dim, HIDDEN),
            f"blk.{i}.attn_output.weight": mat(HIDDEN, HEADS * head_dim),
            f"blk.{i}.ffn_norm.weight": norm(),
            f"blk.{i}.ffn_gate.weight": mat(FFN, HIDDEN),
            f"blk.{i}.ffn_up.weight": mat(FFN, HIDDEN),
            f"blk.{i}.ffn_down.weight": mat(HIDDEN, FFN),
        }
    return out


def _llama_meta(w: gguf.GGUFWriter) -> None:
    tok = build_tokenizer()
    tok_json = json.loads(tok.to_str())
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tok_json["added_tokens"] if a["special"]}
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok_json["model"]["merges"]])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)


def q4_k_m(name: str):
    """llama.cpp's Q4_K_M choice, in short: Q6_K for attn_v, ffn_down and the output head, Q4_K elsewhere."""
    return Q.Q6_K if any(p in name for p in ("attn_v", "ffn_down", "output.weight")) else Q.Q4_K


MIXES = {"Q4_K": lambda name: Q.Q4_K, "Q6_K": lambda name: Q.Q6_K, "Q4_K_M": q4_k_m}


def _llama_files(tmp_path, mix):
    """The model with 2-D weights in `mix`'s types (norms F32), and its twin holding ggml's dequantized values."""
    quantized, floats = {}, {}
    for name, array in _llama_weights().items():
        qtype = MIXES[mix](name) if array.ndim == 2 else Q.F32
        raw = encode(array, qtype)
        quantized[name], floats[name] = (raw, qtype), (reference(raw, qtype), Q.F32)
    return write(tmp_path / f"{mix}.gguf", quantized, _llama_meta), write(tmp_path / "f32.gguf", floats, _llama_meta)


PROMPT = "The capital of France"
STEPS = 24
EOS = 2  # <|im_end|>: suppressed, so that every run generates all STEPS tokens


def _generate(capsys, path) -> tuple[list[int], str]:
    args = ["generate", "-m", str(path), "-p", PROMPT, "-n", str(STEPS), "--json", "--no-chat-template"]
    code = main([*args, "--suppress-token", str(EOS)])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)["token_ids"], err


def _step_logits(path, ids: list[int], n_prompt: int) -> np.ndarray:
    """Teacher-forced logits at every generation step of `ids` (prompt + generated)."""
    model = load_model(str(path), log=lambda m: None).model
    return np.array(model(mx.array([ids]))[0, n_prompt - 1 : -1].astype(mx.float32))


# Max-abs logit difference to the F32 twin. Q4_K is exact (fp32 scales on the CPU): only summation order differs.
# Q6_K is requantized to 8 bits (half a step of range/255 per group of 32, about a quarter of Q6_K's own step):
# measured 0.14 max-abs (logits up to ~5), where Q6_K itself moves them by 0.58 from the unquantized weights.
# Measured 0.072 for the Q4_K_M mix. The greedy tokens agree for all STEPS in every mix (with --no-chat-template).
LOGIT_TOL = {"Q4_K": 1e-4, "Q6_K": 0.2, "Q4_K_M": 0.2}


@pytest.mark.parametrize("mix", list(MIXES))
def test_k_quant_llama_generates_as_its_dequantized_weights(tmp_path, capsys, mix):
    """`mlxcel generate` on the quantized file gives the greedy tokens of its F32 twin (ggml's dequantized values),
    its logits within the layout's error, and the layers keep each tensor's own bits."""
    path, twin = _llama_files(tmp_path, mix)
    tokens, err = _generate(capsys, path)
    twin_tokens, twin_err = _generate(capsys, twin)
    assert len(twin_tokens) == STEPS
    requantized = [line for line in err.splitlines() if "without an MLX layout" in line]
    if mix == "Q4_K":
        assert not requantized
    else:
        assert len(requantized) == 1 and "Q6_K -> 8-bit groups of 32 (requantized)" in requantized[0], err
    assert "without an MLX layout" not in twin_err

    loaded = load_model(str(path), log=lambda m: None)
    prompt = loaded.tokenizer.encode(PROMPT, add_special_tokens=False)
    ours, ref = (_step_logits(p, prompt + twin_tokens, len(prompt)) for p in (path, twin))
    diff = float(np.abs(ours - ref).max())
    same = next((i for i, (a, b) in enumerate(zip(tokens, twin_tokens)) if a != b), STEPS)
    print(f"{mix}: max-abs logit diff to the twin {diff:.3g}; the same greedy tokens for {same} steps")
    assert diff <= LOGIT_TOL[mix]
    assert tokens == twin_tokens

    layer = loaded.model.model.layers[0]
    assert mlx_class_name(loaded.model.model.embed_tokens) == "QuantizedEmbedding"
    assert (layer.self_attn.q_proj.bits, layer.self_attn.q_proj.group_size) == (8 if mix == "Q6_K" else 4, 32)
    assert layer.self_attn.v_proj.bits == (4 if mix == "Q4_K" else 8)  # per-layer bits in a mixed file


def test_loading_peak_memory_stays_within_one_and_a_half_file_sizes(tmp_path, monkeypatch):
    """numpy's peak (tracemalloc) plus MLX's peak while reading a Q4_K_M-style file of ~2 MB with fp32 scales.

    The slab (values converted at once) shrinks with the file, to keep the proportions of a GB-sized model, whose
    1M-value slabs are a few tens of MB."""
    from mlxcel_core.loading import gguf_tensors

    monkeypatch.setattr(gguf_tensors, "_SLAB_VALUES", 2048)
    rng = np.random.default_rng(2)
    tensors = {}
    for i in range(3):
        for part, qtype in (("attn_q", Q.Q4_K), ("ffn_up", Q.Q4_K), ("ffn_gate", Q.Q4_K), ("ffn_down", Q.Q6_K)):
            tensors[f"blk.{i}.{part}.weight"] = (
                encode(rng.standard_normal((256, 1024)).astype(np.float32), qtype),
                qtype,
            )
    path = write(tmp_path / "m.gguf", tensors)
    size = path.stat().st_size
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    tracemalloc.start()
    loaded, _ = read_gguf_tensors(path)
    _, numpy_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    mlx_peak = mx.get_peak_memory() - base
    print(f"file {size} B, numpy peak {numpy_peak} B, MLX peak {mlx_peak} B: {(numpy_peak + mlx_peak) / size:.2f}x")
    assert len(loaded) == len(tensors) and numpy_peak + mlx_peak <= 1.5 * size


def _one_line_error(capsys, path) -> str:
    code = main(["generate", "-m", str(path), "-p", "hello", "-n", "2"])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1 and lines[0].startswith("mlxcel: error: "), err
    return lines[0]


def test_truncated_file_is_named_truncated_through_the_cli(tmp_path, capsys):
    path, _ = _llama_files(tmp_path, "Q4_K")
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    for end in (len(data) // 2, len(data) - 1, 2000, 40):  # in the tensor data, in the vocabulary, in the header
        cut.write_bytes(data[:end])
        assert "truncated" in _one_line_error(capsys, cut), end


def test_unsupported_type_through_the_cli_is_one_line(tmp_path, capsys):
    weights = _llama_weights()
    tensors = {
        name: (encode(a, Q.Q4_K if a.ndim == 2 else Q.F32), Q.Q4_K if a.ndim == 2 else Q.F32)
        for name, a in weights.items()
    }
    tensors["blk.0.ffn_up.weight"] = (np.zeros((FFN, HIDDEN // 256 * 66), np.uint8), Q.IQ2_XXS)
    line = _one_line_error(capsys, write(tmp_path / "iq2.gguf", tensors, _llama_meta))
    assert "blk.0.ffn_up.weight" in line and "IQ2_XXS" in line and "supported: F32, F16, BF16, Q4_0" in line


@pytest.mark.parametrize(
    "arch, kinds, want",
    [
        ("llama", {"F32", "Q4_K", "Q6_K"}, mx.float16),
        ("qwen2", {"F32", "F16"}, mx.float16),
        ("qwen2", {"F32", "BF16", "Q8_0"}, mx.bfloat16),
        ("gemma3", {"F32", "Q4_K"}, mx.bfloat16),
        ("gemma4", {"F32", "F16"}, mx.bfloat16),
        ("llama", {"F32"}, mx.float32),
    ],
)
def test_the_gpu_computes_a_file_in_its_half_dtype(arch, kinds, want):
    from mlxcel_core.loading.gguf import gpu_dtype

    assert gpu_dtype({"general.architecture": arch}, kinds) == want


def test_a_chosen_dtype_reaches_scales_and_float_tensors(tmp_path):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    path = write(tmp_path / "t.gguf", {"q.weight": (encode(x, Q.Q4_0), Q.Q4_0), "n.weight": (x[0], Q.F32)})
    seen = []

    def pick(meta, kinds):
        seen.append((str(meta["general.architecture"]), kinds))
        return mx.bfloat16

    tensors, _ = read_gguf_tensors(path, scale_dtype=pick, cast_floats=True)
    assert seen == [("llama", {"Q4_0", "F32"})]
    assert tensors["q.weight"].scales.dtype == mx.bfloat16 and tensors["n.weight"].dtype == mx.bfloat16
    np.testing.assert_allclose(as_numpy(tensors["n.weight"]), x[0], rtol=2**-8)
    kept, _ = read_gguf_tensors(path, scale_dtype=mx.float16)  # float tensors keep their own dtype
    assert kept["q.weight"].scales.dtype == mx.float16 and kept["n.weight"].dtype == mx.float32
