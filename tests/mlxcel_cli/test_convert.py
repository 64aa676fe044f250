"""`mlxcel convert`: tiny transformers checkpoints (llama, qwen3) and GGUF files -> MLX directories, checked through
the CLI: the unquantized copy's greedy tokens equal the source's, a 4-bit copy computes the fp32 architecture on
its dequantized weights, and mlx-lm (where importable) loads each copy to the same logits as mlxcel."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from family_checks import cli_tokens
from gguf_convert import convert as write_gguf
from parity import dequantized_logits, load_quiet, logits, mlx_lm_model, prompt_ids
from tiny_models import save_tiny_checkpoint, save_tiny_llama

from mlxcel_cli.main import main

QWEN3 = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    tie_word_embeddings=True,
    initializer_range=0.1,
)
STEPS = 24


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    root = tmp_path_factory.mktemp("convert-src")
    return {
        "llama": save_tiny_llama(root / "llama"),
        "qwen3": save_tiny_checkpoint(root / "qwen3", Qwen3Config, Qwen3ForCausalLM, **QWEN3),
    }


def _convert(capsys, *args) -> tuple[int, str, str]:
    code = main(["convert", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def _mlx_lm_logits(path, prompt) -> np.ndarray:
    model = mlx_lm_model(path)
    return np.array(model(mx.array([prompt])).astype(mx.float32))[0]


def _assert_mlx_lm_equal(path) -> None:
    prompt = prompt_ids(24)
    np.testing.assert_allclose(_mlx_lm_logits(path, prompt), logits(load_quiet(path).model, prompt), atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_unquantized_copy_generates_the_same_tokens(sources, family, tmp_path, capsys):
    src, out = sources[family], tmp_path / "mlx"
    code, _, err = _convert(capsys, src, "-o", out)
    assert code == 0, err
    assert "writing model.safetensors" in err
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config = json.loads((out / "config.json").read_text())
    assert "quantization" not in config and config["model_type"] == family
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model.safetensors"}
    assert cli_tokens(out, steps=STEPS)["token_ids"] == cli_tokens(src, steps=STEPS)["token_ids"]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_4bit_copy_is_the_quantized_source(sources, family, tmp_path, capsys):
    src, out = sources[family], tmp_path / "q4"
    code, _, err = _convert(capsys, src, "-o", out, "-q", "--q-bits", "4", "--q-group-size", "64")
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    assert config["quantization_config"] == config["quantization"]
    quantized = load_quiet(out).model
    ours = logits(quantized)
    # The quantized kernels compute the fp32 architecture on the dequantized weights (family_checks' tolerance) ...
    np.testing.assert_allclose(ours, dequantized_logits(src, quantized), atol=1e-4, rtol=0)
    # ... and quantization really happened.
    assert np.abs(ours - logits(load_quiet(src).model)).max() > 1e-3
    assert len(cli_tokens(out, steps=STEPS)["token_ids"]) == STEPS
    _assert_mlx_lm_equal(out)


def test_mixed_recipe_follows_mlx_lm(sources, tmp_path, capsys):
    out = tmp_path / "mixed"
    code, _, err = _convert(capsys, sources["llama"], "-o", out, "-q", "--q-recipe", "mixed_3_6")
    assert code == 0, err
    quant = json.loads((out / "config.json").read_text())["quantization"]
    bits = {path: entry["bits"] for path, entry in quant.items() if isinstance(entry, dict)}
    # 2 layers: layer 1 is in the last eighth (its v_proj and down_proj get 6 bits), layer 0 is not.
    high = {"lm_head", "model.embed_tokens", "model.layers.1.self_attn.v_proj", "model.layers.1.mlp.down_proj"}
    assert {p for p, b in bits.items() if b == 6} == high
    assert {p for p, b in bits.items() if b == 3} == {
        f"model.layers.{i}.{name}"
        for i in (0, 1)
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
        + ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    } - high
    model = load_quiet(out).model
    assert model.lm_head.bits == 6 and model.model.layers[0].self_attn.v_proj.bits == 3
    _assert_mlx_lm_equal(out)


def _q4_0_gguf(monkeypatch, src, path):
    """The F32 GGUF of `src` with every 2-D tensor stored as Q4_0 instead."""
    import gguf

    q4_0, add_tensor = gguf.GGMLQuantizationType.Q4_0, gguf.GGUFWriter.add_tensor

    def quantized(self, name, tensor, *args, raw_dtype=None, **kwargs):
        if tensor.ndim == 2 and raw_dtype is None:
            return add_tensor(self, name, gguf.quants.quantize(tensor, q4_0), *args, raw_dtype=q4_0, **kwargs)
        return add_tensor(self, name, tensor, *args, raw_dtype=raw_dtype, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(gguf.GGUFWriter, "add_tensor", quantized)
        return write_gguf(src, path, "llama")


@pytest.mark.parametrize("qtype", ["F32", "Q4_0"])
def test_gguf_source(sources, qtype, tmp_path, monkeypatch, capsys):
    gguf_path = tmp_path / f"tiny-{qtype}.gguf"
    if qtype == "F32":
        write_gguf(sources["llama"], gguf_path, "llama")
    else:
        _q4_0_gguf(monkeypatch, sources["llama"], gguf_path)
    out = tmp_path / "mlx"
    code, _, err = _convert(capsys, gguf_path, "-o", out)
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())
    want = None if qtype == "F32" else {"group_size": 32, "bits": 4, "mode": "affine"}
    assert config.get("quantization") == want
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"].startswith("{% for message in messages %}")
    assert cli_tokens(out, steps=STEPS)["token_ids"] == cli_tokens(gguf_path, steps=STEPS)["token_ids"]
    _assert_mlx_lm_equal(out)
    mlx_lm = pytest.importorskip("mlx_lm")
    _, tokenizer = mlx_lm.load(str(out))
    text = "The capital of France is Paris. héllo 🙂"
    assert tokenizer.encode(text) == load_quiet(gguf_path).tokenizer.encode(text)


def test_dequantize_and_dtype(sources, tmp_path, capsys):
    q4, floats, half = tmp_path / "q4", tmp_path / "dequantized", tmp_path / "half"
    assert _convert(capsys, sources["llama"], "-o", q4, "-q")[0] == 0
    code, _, err = _convert(capsys, q4, "-o", floats, "--dequantize")
    assert code == 0, err
    assert "quantization" not in json.loads((floats / "config.json").read_text())
    assert all(v.dtype == mx.float32 for v in mx.load(str(floats / "model.safetensors")).values())
    np.testing.assert_allclose(logits(load_quiet(floats).model), logits(load_quiet(q4).model), atol=1e-5)
    code, _, err = _convert(capsys, sources["llama"], "-o", half, "--dtype", "float16")
    assert code == 0, err
    assert {v.dtype for v in mx.load(str(half / "model.safetensors")).values()} == {mx.float16}
    assert json.loads((half / "config.json").read_text())["torch_dtype"] == "float16"


def test_json_and_force(sources, tmp_path, capsys):
    out = tmp_path / "mlx"
    code, stdout, err = _convert(capsys, sources["llama"], "-o", out, "--json")
    assert code == 0 and err == ""
    result = json.loads(stdout)
    assert result["path"] == str(out) and result["quantization"] is None and result["parameters"] > 0
    assert result["source"] == str(sources["llama"])  # a path, not a sentence
    code, _, err = _convert(capsys, sources["llama"], "-o", out, "-q")
    assert code == 2 and err == f"mlxcel: error: {out} already exists (pass --force to replace it)\n"
    assert "quantization" not in json.loads((out / "config.json").read_text())
    code, _, err = _convert(capsys, sources["llama"], "-o", out, "-q", "--force")
    assert code == 0, err
    assert json.loads((out / "config.json").read_text())["quantization"]["bits"] == 4
    assert [p.name for p in tmp_path.iterdir()] == ["mlx"]  # no partial directory left behind


@pytest.mark.parametrize(
    "args, message",
    [
        (["-q", "--q-bits", "7"], "--q-bits must be one of 2, 3, 4, 5, 6, 8, got 7"),
        (["-q", "--q-group-size", "48"], "--q-group-size must be one of 32, 64, 128, got 48"),
        (["-q", "--q-recipe", "mixed_9_9"], "--q-recipe must be one of mixed_2_6, mixed_3_4, mixed_3_6, mixed_4_6"),
        (["-q", "--dequantize"], "choose -q/--quantize or --dequantize, not both"),
        (["--dequantize"], "--dequantize: the source is not quantized"),
        (["--dtype", "int8"], "--dtype must be one of float16, bfloat16, float32, got 'int8'"),
    ],
)
def test_bad_options(sources, args, message, tmp_path, capsys):
    code, _, err = _convert(capsys, sources["llama"], "-o", tmp_path / "out", *args)
    assert code == 2
    assert err.startswith(f"mlxcel: error: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_unreadable_sources(tmp_path, capsys):
    code, _, err = _convert(capsys, tmp_path / "missing", "-o", tmp_path / "out")
    assert code == 2 and err.startswith("mlxcel: error: model path") and err.count("\n") == 1, err
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file")
    code, _, err = _convert(capsys, broken, "-o", tmp_path / "out")
    assert code == 2 and err.count("\n") == 1 and "broken.gguf" in err, err
    assert not (tmp_path / "out").exists()


def test_quantized_source_is_not_requantized(sources, tmp_path, capsys):
    q4 = tmp_path / "q4"
    assert _convert(capsys, sources["llama"], "-o", q4, "-q")[0] == 0
    code, _, err = _convert(capsys, q4, "-o", tmp_path / "q2", "-q", "--q-bits", "2")
    assert code == 2 and "already quantized" in err and err.count("\n") == 1, err
