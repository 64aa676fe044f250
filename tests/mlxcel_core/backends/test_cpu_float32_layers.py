"""On the CPU with OpenBLAS, quantized and half-precision layers compute float32 products of their (dequantized)
weights (backends/cpu_float32.py): the greedy tokens of MLX's own kernels, the parameters kept (and restored as MLX's
classes by unprepare), embeddings copied only where the output projection is tied to them, and no copies where they
would not fit."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from mlxcel_core.backends import cpu_float32
from mlxcel_core.bench_model import RandomIdTokenizer
from mlxcel_core.engine import Engine, EngineConfig
from mlxcel_core.loading.shapes import build_random_model, shape_config
from mlxcel_core.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not cpu_float32.applies(), reason="not on the CPU with OpenBLAS")


PROMPTS = [[5, 9, 33, 2, 71, 18, 40], [12, 4, 4, 90], [61, 3, 27, 8, 15, 99, 42, 7, 23, 11, 5]]


def _model(bits: int = 4):
    """The tiny shape, quantized, as MLX's quantized classes (prepare undone)."""
    model, config = build_random_model("tiny", bits=bits, dtype="float32", seed=3)
    cpu_float32.unprepare(model)
    return model, config


def _greedy(model, config, prompts: list[list[int]], steps: int = 40) -> list[list[int]]:
    engine = Engine(model, RandomIdTokenizer(config["vocab_size"]), EngineConfig(max_batch_size=len(prompts)))
    seqs = [engine.open(p, SamplingParams(max_tokens=steps)) for p in prompts]
    out = {s: [] for s in seqs}
    while engine.has_work():
        for step in engine.step():
            assert step.error is None
            if step.token is not None:
                out[step.seq_id].append(step.token)
    return [out[s] for s in seqs]


@pytest.mark.parametrize("bits", [4, 8])
def test_the_float32_products_give_the_quantized_kernels_greedy_tokens(bits):
    model, config = _model(bits)
    prompts = PROMPTS
    x = mx.random.normal((3, model.model.layers[0].self_attn.q_proj.weight.shape[1] * 32 // bits), key=mx.random.key(0))
    q_proj = model.model.layers[0].self_attn.q_proj
    kernel = q_proj(x)
    plain = _greedy(model, config, prompts)

    assert cpu_float32.prepare(model) > 0
    assert type(q_proj) is cpu_float32.Float32QuantizedLinear and isinstance(q_proj, nn.QuantizedLinear)
    assert mx.allclose(q_proj(x), kernel, rtol=1e-5, atol=1e-5).item()
    assert _greedy(model, config, prompts) == plain  # batched, as the plain run was
    assert [_greedy(model, config, [p])[0] for p in prompts] == plain  # and each alone


def test_parameters_stay_quantized_and_unprepare_restores_mlxs_classes():
    model, _ = _model()
    before = {k: v for k, v in tree_flatten(model.parameters())}
    swapped = cpu_float32.prepare(model)
    after = {k: v for k, v in tree_flatten(model.parameters())}
    assert swapped > 0 and before.keys() == after.keys()  # the float32 copies are not parameters
    assert all(after[k] is before[k] for k in before)
    assert cpu_float32.unprepare(model) == swapped
    kinds = {type(m) for _, m in model.named_modules()}
    assert nn.QuantizedLinear in kinds and not kinds & set(cpu_float32.SWAPS.values())
    assert not any(hasattr(m, "float32") for _, m in model.named_modules())


def test_no_copies_where_they_would_not_fit(monkeypatch):
    model, _ = _model()
    monkeypatch.setattr(cpu_float32, "device_memory_bytes", lambda: 1 << 20)  # a 1 MiB machine
    assert cpu_float32.prepare(model) == 0
    assert all(type(m) not in cpu_float32.SWAPS.values() for _, m in model.named_modules())


def test_loading_and_building_take_the_swap():
    model, _ = build_random_model("tiny", bits=4, dtype="float32", seed=3)
    assert any(type(m) is cpu_float32.Float32QuantizedLinear for _, m in model.named_modules())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("tied", [False, True])
def test_half_precision_layers_give_mlxs_greedy_tokens(dtype, tied):
    model, config = build_random_model(
        "tiny", dtype=dtype, seed=3, config={**shape_config("tiny"), "tie_word_embeddings": tied}
    )
    kinds = {type(m) for _, m in model.named_modules()}
    assert cpu_float32.Float32Linear in kinds and (cpu_float32.Float32Embedding in kinds) == tied
    q_proj = model.model.layers[0].self_attn.q_proj
    assert q_proj.weight.dtype == getattr(mx, dtype) and not hasattr(q_proj, "bits")
    x = mx.random.normal((3, q_proj.weight.shape[1]), key=mx.random.key(0)).astype(getattr(mx, dtype))
    fast, fast_x = _greedy(model, config, PROMPTS), q_proj(x)
    assert fast_x.dtype == x.dtype

    assert cpu_float32.unprepare(model) > 0 and type(q_proj) is nn.Linear
    assert mx.allclose(q_proj(x), fast_x, rtol=1e-2, atol=1e-3).item()
    assert _greedy(model, config, PROMPTS) == fast


def test_float32_layers_are_left_to_mlx():
    model, _ = build_random_model("tiny", dtype="float32", seed=3)
    assert not any(type(m) in cpu_float32.SWAPS.values() for _, m in model.named_modules())


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_the_float32_copy_is_mlxs_dequantization_from_float32_scales(bits, group_size, dtype):
    """Every width (unpacked by MLX ops): the values of mx.dequantize with the scales and biases in float32, bit for
    bit."""
    layer = nn.QuantizedLinear(256, 40, bias=False, group_size=group_size, bits=bits)
    layer.scales, layer.biases = layer.scales.astype(dtype), layer.biases.astype(dtype)
    f32 = mx.float32
    want = mx.dequantize(
        layer.weight, layer.scales.astype(f32), layer.biases.astype(f32), group_size=group_size, bits=bits
    )
    got = cpu_float32._float32_weight(layer)
    assert got.dtype == mx.float32 and mx.array_equal(got, want).item()
