"""quantize_checkpoint: an MLX-quantized directory that our loader reads back as the in-memory quantized model."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlxcel_core import backends
from mlxcel_core.errors import InputError
from mlxcel_core.loading import load_model
from mlxcel_core.quantize import quantize_checkpoint

PROMPT = mx.array([[5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 200, 31]])
# Max-abs logit difference to the fp32 model. The tiny random Llama's logits span about +-2.9 (std 0.8);
# measured: 4-bit/64 1.04, 8-bit/64 0.058 (random weights quantize worse than trained ones).
FP32_TOLERANCE = {4: 1.5, 8: 0.1}


def quiet(path):
    return load_model(str(path), log=lambda m: None)


def logits(model):
    return np.array(model(PROMPT))


def in_memory(src, bits, group_size):
    """The reference: our fp32 model quantized in memory with mlx's own predicate-free call, its backend preparation
    undone before and made again after, as load_model prepares the quantized checkpoint (on CUDA: the fp32 fused
    projections unfused, then the quantized layers MLX's quantized_matmul computes wrong routed around)."""
    model = quiet(src).model
    backends.current().unprepare_model(model)
    nn.quantize(
        model,
        group_size=group_size,
        bits=bits,
        class_predicate=lambda _, m: isinstance(m, (nn.Linear, nn.Embedding)) and m.weight.shape[-1] % group_size == 0,
    )
    backends.current().prepare_model(model)
    return model


@pytest.mark.parametrize("bits", [4, 8])
def test_round_trip_equals_in_memory_quantized_model(tiny_llama_dir, tmp_path, bits):
    dst = quantize_checkpoint(tiny_llama_dir, tmp_path / f"q{bits}", bits=bits, group_size=64)
    assert dst == tmp_path / f"q{bits}"
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": bits}
    assert config["model_type"] == "llama"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (dst / name).read_bytes() == (tiny_llama_dir / name).read_bytes()
    assert sorted(p.name for p in dst.glob("*.safetensors")) == ["model.safetensors"]

    loaded = quiet(dst)
    attn = loaded.model.model.layers[0].self_attn
    assert isinstance(attn.q_proj, nn.QuantizedLinear) and (attn.q_proj.bits, attn.q_proj.group_size) == (bits, 64)
    assert isinstance(loaded.model.model.layers[0].mlp.down_proj, nn.QuantizedLinear)
    assert isinstance(loaded.model.model.embed_tokens, nn.QuantizedEmbedding)
    assert isinstance(loaded.model.lm_head, nn.QuantizedLinear)
    assert loaded.tokenizer.encode("Hello world") == quiet(tiny_llama_dir).tokenizer.encode("Hello world")

    ours = logits(loaded.model)
    np.testing.assert_array_equal(ours, logits(in_memory(tiny_llama_dir, bits, 64)))
    diff = float(np.abs(ours - logits(quiet(tiny_llama_dir).model)).max())
    print(f"{bits}-bit/64 max-abs logit vs fp32: {diff:.4g}")
    assert 0 < diff <= FP32_TOLERANCE[bits]
    src_bytes = (tiny_llama_dir / "model.safetensors").stat().st_size
    assert (dst / "model.safetensors").stat().st_size < src_bytes * (0.25 if bits == 4 else 0.4)


def test_layers_whose_input_dim_does_not_divide_stay_unquantized(tiny_llama_dir, tmp_path):
    """group_size 128: only down_proj (input 128) is quantized; hidden-64 layers keep fp32 and load back."""
    dst = quantize_checkpoint(tiny_llama_dir, tmp_path / "g128", bits=4, group_size=128)
    model = quiet(dst).model
    layer = model.model.layers[0]
    assert isinstance(layer.mlp.down_proj, nn.QuantizedLinear) and layer.mlp.down_proj.group_size == 128
    assert type(layer.self_attn.q_proj) is nn.Linear and type(model.model.embed_tokens) is nn.Embedding
    np.testing.assert_array_equal(logits(model), logits(in_memory(tiny_llama_dir, 4, 128)))


def test_refuses_bad_arguments(tiny_llama_dir, tmp_path):
    with pytest.raises(InputError, match="bits must be one of"):
        quantize_checkpoint(tiny_llama_dir, tmp_path / "a", bits=7)
    with pytest.raises(InputError, match="group_size must be one of"):
        quantize_checkpoint(tiny_llama_dir, tmp_path / "a", group_size=48)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(InputError, match="already exists"):
        quantize_checkpoint(tiny_llama_dir, tmp_path / "full")
    once = quantize_checkpoint(tiny_llama_dir, tmp_path / "once")
    with pytest.raises(InputError, match="already quantized"):
        quantize_checkpoint(once, tmp_path / "twice")
    with pytest.raises(InputError, match="not a model directory"):
        quantize_checkpoint(tmp_path / "missing", tmp_path / "b")
