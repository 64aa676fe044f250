"""Compiled (shapeless) fused activations equal their eager forms for every shape, dtype and cap."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch

from mlxcel_core.models.activations import geglu, geglu_eager, softcap, softcap_eager, swiglu, swiglu_eager

# Shapes of different ranks and sizes, called in sequence: a shapeless graph traced on the first
# must not reuse that shape (or a broadcast of it) for the later ones.
SHAPES = [(2, 3, 128), (1, 1, 64), (5, 7), (3, 17, 257), (4096,), (1, 2, 3, 40)]
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
# Eager half-precision ops round after every op; the fused kernel may keep intermediates wider,
# so allow a couple of ulps of the output format (relative to the value's magnitude).
RTOL = {mx.float32: 0.0, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}


def _inputs(shape, dtype, seed, scale=4.0):
    rng = np.random.default_rng(seed)
    a = mx.array((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)
    b = mx.array((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)
    return a, b


def _assert_close(got, want, dtype):
    assert got.shape == want.shape and got.dtype == want.dtype == dtype
    g, w = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    if dtype == mx.float32:
        np.testing.assert_array_equal(g, w)
    else:
        np.testing.assert_allclose(g, w, rtol=RTOL[dtype], atol=RTOL[dtype])


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("op,eager", [(swiglu, swiglu_eager), (geglu, geglu_eager)], ids=["swiglu", "geglu"])
def test_gated_ops_match_eager_across_shapes(op, eager, dtype):
    dt = DTYPES[dtype]
    for seed, shape in enumerate(SHAPES):
        gate, up = _inputs(shape, dt, seed)
        _assert_close(op(gate, up), eager(gate, up), dt)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_softcap_matches_eager_for_each_cap_and_shape(dtype):
    dt = DTYPES[dtype]
    # Alternate caps and shapes so neither a cap nor a shape from an earlier call can be reused.
    for seed, (shape, cap) in enumerate(zip(SHAPES * 2, [30.0, 50.0, 5.0, 30.0, 0.5, 50.0, 7.25] * 2)):
        x, _ = _inputs(shape, dt, seed, scale=60.0)
        got = softcap(x, cap)
        _assert_close(got, softcap_eager(x, cap), dt)
        assert float(mx.abs(got.astype(mx.float32)).max()) <= cap * (1 + RTOL[dt])


def test_softcap_caps_differ():
    """A constant baked into the compiled graph would make every cap give the same result."""
    x = mx.array([100.0, -3.0, 0.25])
    assert softcap(x, 30.0).tolist() != softcap(x, 50.0).tolist()
    np.testing.assert_allclose(np.array(softcap(x, 30.0)), np.tanh(np.array([100.0, -3.0, 0.25]) / 30) * 30, rtol=1e-6)


def test_definitions_match_torch():
    """The eager forms are the functions transformers uses (SiLU, gelu_pytorch_tanh)."""
    gate, up = _inputs((3, 256), mx.float32, 7)
    tg, tu = torch.tensor(np.array(gate)), torch.tensor(np.array(up))
    np.testing.assert_allclose(
        np.array(swiglu(gate, up)), (torch.nn.functional.silu(tg) * tu).numpy(), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(
        np.array(geglu(gate, up)), (torch.nn.functional.gelu(tg, approximate="tanh") * tu).numpy(), rtol=1e-5, atol=1e-5
    )
