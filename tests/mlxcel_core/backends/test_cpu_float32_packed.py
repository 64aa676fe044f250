"""csrc/blas_packed.c through cpu_blas.py and backends/cpu_float32.py: a 4- or 8-bit layer's products read its packed
values instead of its float32 copy, with the copy's bits: every row count, row slices of the weight, batched rows
equal to lone ones, the same greedy tokens, weights that are not the packed values' dequantization refused, and a
weight untied when its layer lets it go."""

from __future__ import annotations

import gc

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlxcel_core import cpu_blas
from mlxcel_core.backends import cpu_float32

pytestmark = pytest.mark.skipif(
    not cpu_float32.applies() or not cpu_blas.status().startswith(cpu_blas.ACTIVE[0]),
    reason="needs mlxcel's AVX2 rows on the CPU",
)


def _layer(n: int, k: int, bits: int, group_size: int, seed: int = 0) -> nn.QuantizedLinear:
    mx.random.seed(seed)
    layer = nn.QuantizedLinear(k, n, bias=False, group_size=group_size, bits=bits)
    holder = nn.Module()
    holder.layer = layer
    assert cpu_float32.prepare(holder) == 1
    return layer


def _products(layer, xs):
    ys = [layer(x) for x in xs]
    mx.eval(ys)
    return ys


@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, 64), (4, 128), (8, 32), (8, 64)])
@pytest.mark.parametrize("n,k", [(37, 256), (300, 640)])
def test_the_packed_products_are_the_float32_products_bit_for_bit(bits, group_size, n, k):
    layer = _layer(n, k, bits, group_size)
    assert layer.float32.packed
    x = mx.random.normal((12, k), key=mx.random.key(1))
    xs = [x[:rows] for rows in (1, 2, 3, 4, 5, 8, 12)]
    before = cpu_blas.packed_products()
    packed = _products(layer, xs)
    assert cpu_blas.packed_products() - before == 6  # (1..8 rows from the packed values; 12 rows from the copy)
    assert cpu_blas.unregister_packed(layer.float32.weight)
    layer.float32.packed = False
    plain = _products(layer, xs)
    assert cpu_blas.packed_products() - before == 6
    for rows, a, b in zip((1, 2, 3, 4, 5, 8, 12), packed, plain):
        assert mx.array_equal(a, b).item(), f"{rows} rows"
    assert all(mx.array_equal(packed[-1][: len(a)], a).item() for a in packed[:-1])  # each row the same in any batch


@pytest.mark.skipif(not cpu_blas.rows_wide_available(), reason="no AVX-512F and DQ on this CPU")
@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, 64), (8, 32), (8, 128)])
def test_the_avx512_packed_products_give_the_avx2_ones_bits(bits, group_size):
    """Blocks of 8 and 4 rows against 2 weight rows made in one AVX-512 register, against the AVX2 blocks: every row
    count a packed product takes (8 or 4 rows a block, then one at a time) and an odd number of weight rows."""
    layer = _layer(37, 256, bits, group_size, seed=bits + group_size)
    x = mx.random.normal((8, 256), key=mx.random.key(3))
    xs = [x[:rows] for rows in range(1, 9)]
    before, was = cpu_blas.packed_products(), cpu_blas.rows_wide()
    try:
        results = {}
        for wide in (False, True):
            cpu_blas.set_rows_wide(wide)
            results[wide] = _products(layer, xs)
    finally:
        cpu_blas.set_rows_wide(was)
    assert cpu_blas.packed_products() - before == 16
    for rows, a, b in zip(range(1, 9), results[False], results[True]):
        assert mx.array_equal(a, b).item(), f"{rows} rows"


def test_a_slice_of_the_weights_rows_reads_the_packed_values():
    layer = _layer(96, 256, 4, 64)
    w = layer.float32.weight
    x = mx.random.normal((2, 256), key=mx.random.key(2))
    before = cpu_blas.packed_products()
    sliced = x @ w[40:72].T
    mx.eval(sliced)
    hits = cpu_blas.packed_products() - before
    full = x @ w.T
    mx.eval(full)
    assert hits == 1 and mx.array_equal(sliced, full[:, 40:72]).item()


def test_a_weight_that_is_not_the_dequantization_is_refused():
    layer = _layer(64, 256, 4, 64)
    scales = layer["scales"].astype(mx.float32) * 1.0001
    biases = layer["biases"].astype(mx.float32)
    other = mx.array(layer.float32.weight * 1.0)  # (another buffer holding the same values)
    mx.eval(scales, biases, other)
    assert not cpu_blas.register_packed(other, layer["weight"], scales, biases, 64, 4)
    good = layer["scales"].astype(mx.float32)
    assert cpu_blas.register_packed(other, layer["weight"], good, biases, 64, 4)
    assert cpu_blas.register_packed(other, layer["weight"], good, biases, 64, 4)  # (again: the one entry replaced)
    assert cpu_blas.unregister_packed(other)
    assert not cpu_blas.unregister_packed(other)
    assert not cpu_blas.register_packed(other, layer["weight"], scales, biases, 64, 3)  # (widths it reads: 4 and 8)


def test_a_layer_that_lets_its_copy_go_unties_it():
    layer = _layer(64, 256, 8, 32)
    weight = layer.float32.weight
    holder = nn.Module()
    holder.layer = layer
    assert cpu_float32.unprepare(holder) == 1
    gc.collect()
    assert not cpu_blas.unregister_packed(weight)  # (already untied)


def test_greedy_tokens_are_the_float32_copies():
    from test_cpu_float32_layers import PROMPTS, _greedy, _model

    model, config = _model(4)
    assert cpu_float32.prepare(model) > 0
    before = cpu_blas.packed_products()
    packed = _greedy(model, config, PROMPTS)
    assert cpu_blas.packed_products() > before
    for _, module in model.named_modules():
        if getattr(getattr(module, "float32", None), "packed", False):
            assert cpu_blas.unregister_packed(module.float32.weight)
            module.float32.packed = False
    before = cpu_blas.packed_products()
    assert _greedy(model, config, PROMPTS) == packed
    assert cpu_blas.packed_products() == before
