"""The residual add taken into o_proj / down_proj (kernels/qmv.py mode "residual", FastQuantizedLinear.add_to).

Everywhere: the decoder layers hand the residual to the output projections, add_to is the separate add, and fusion
marks and swaps the output projections. CUDA only: the kernel's residual mode and the model's decode, bit for bit
against the separate add.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from test_fused_projections import _decode_logits
from test_qmv import make_operands, needs_cuda

from mlxcel_core.backends.cuda.kernels import fast_linear, hmv, qmv
from mlxcel_core.backends.cuda.kernels.fused_projections import fuse_projections, unfuse_projections
from mlxcel_core.loading.shapes import build_random_model


class _RecordingProjection(nn.Linear):
    """An AddsResidual layer that records its calls (add_to returns what the plain add would)."""

    calls = 0

    def add_to(self, x, residual):
        type(self).calls += 1
        return residual + self(x)


def test_decoder_layers_hand_the_residual_to_the_output_projections():
    from mlxcel_core.models.transformer import AddsResidual, adds_residual

    _RecordingProjection.calls = 0
    model, _ = build_random_model("tiny", dtype="float32", seed=3)
    prompt = mx.array([[3, 1, 4, 1, 5]])
    want = model(prompt)
    for layer in model.layers:
        layer.self_attn.o_proj.__class__ = _RecordingProjection
        layer.mlp.down_proj.__class__ = _RecordingProjection
    assert isinstance(model.layers[0].mlp.down_proj, AddsResidual)
    assert not isinstance(nn.Linear(2, 2), AddsResidual)
    assert adds_residual(_RecordingProjection) and not adds_residual(nn.Linear)  # what add_projection asks
    assert mx.array_equal(model(prompt), want).item()  # residual + layer(x) == x + layer(x), bit for bit
    assert _RecordingProjection.calls == 2 * len(model.layers)


def test_add_to_is_the_separate_add():
    """On CUDA through the kernel (bit for bit, as test_residual_mode_is_the_kernel_then_the_add), elsewhere the
    add itself; a residual of another dtype takes the separate add everywhere."""
    from mlxcel_core.backends.cuda.kernels.fast_linear import FastQuantizedLinear

    model, _ = build_random_model("llama-3.2-1b" if qmv.kernel_ready() else "tiny", bits=4, seed=5)
    down = model.layers[0].mlp.down_proj
    down.__class__ = FastQuantizedLinear
    down.fuses_residual = True
    x = mx.random.normal((1, 1, down["weight"].shape[1] * 8), key=mx.random.key(1)).astype(mx.bfloat16)
    residual = mx.random.normal((1, 1, down["weight"].shape[0]), key=mx.random.key(2)).astype(mx.bfloat16)
    got = down.add_to(x, residual)
    assert mx.array_equal(got, residual + down(x)).item()
    assert mx.array_equal(down.add_to(x, residual.astype(mx.float32)), residual.astype(mx.float32) + down(x)).item()


@needs_cuda
@pytest.mark.parametrize("m", [1, 2, 5])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32], ids=["bf16", "fp16", "f32"])
def test_residual_mode_is_the_kernel_then_the_add(m, dtype):
    """Bit for bit: the product rounded to the output dtype, then the add rounded once (as a separate add)."""
    n, k = 4096, 4096
    x, w, scales, biases = make_operands(m, n, k, dtype, seed=m)
    residual = mx.random.normal((m, n), key=mx.random.key(m)).astype(dtype)
    plain = qmv.launch(qmv.launch_args(x.shape, x.dtype, scales.dtype, n, 64), x, w, scales, biases)
    args = qmv.launch_args(x.shape, x.dtype, scales.dtype, n, 64, mode="residual")
    fused = qmv.launch(args, x, w, scales, biases, "residual", (residual,))
    assert fused.dtype == dtype and fused.shape == (m, n)
    assert mx.array_equal(fused, residual + plain).item(), mx.abs(fused - (residual + plain)).max()


@needs_cuda
def test_model_decode_with_the_residual_add_fused_is_bit_identical(monkeypatch):
    from mlxcel_core.backends.cuda.kernels.fast_linear import FastQuantizedLinear

    model, _ = build_random_model("llama-3.2-1b", bits=4, dtype="bfloat16", seed=7)
    fuse_projections(model)  # (none left to fuse where the backend's prepare step fused them)
    down = model.layers[0].mlp.down_proj
    assert type(down) is FastQuantizedLinear and down.fuses_residual
    fused = [_decode_logits(model, batch) for batch in (1, 2)]  # 1..LAYER_MAX_ROWS rows: the kernel's calls
    monkeypatch.setattr(FastQuantizedLinear, "add_to", lambda self, x, residual: residual + self(x))
    separate = [_decode_logits(model, batch) for batch in (1, 2)]
    fused, separate = mx.concatenate(fused), mx.concatenate(separate)
    assert mx.array_equal(fused, separate).item(), mx.abs(fused - separate).max()


def test_fusion_marks_the_fast_output_projections(monkeypatch):
    from mlxcel_core.backends.cuda.kernels.fast_linear import FastQuantizedLinear, use_fast_quantized_linear

    monkeypatch.setattr(fast_linear, "MIN_WEIGHT", 0)  # swap even the tiny layers
    model, _ = build_random_model("tiny", bits=4, seed=2)
    unfuse_projections(model)  # separate (where the backend's prepare step fused them: CUDA)
    use_fast_quantized_linear(model)
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert type(attn.o_proj) is FastQuantizedLinear and not attn.o_proj.fuses_residual
    fuse_projections(model)
    assert attn.o_proj.fuses_residual and mlp.down_proj.fuses_residual and not attn.q_proj.fuses_residual
    unfuse_projections(model)
    assert not attn.o_proj.fuses_residual and not mlp.down_proj.fuses_residual


def test_fusion_swaps_output_projections_below_the_size_threshold(monkeypatch):
    """An o_proj / down_proj too small for fast_linear's swap (a 1B model's o_proj) still gets the kernel class when
    the residual is fused (one launch instead of a matvec and an add); the other small layers stay MLX's."""
    from mlxcel_core.backends.cuda.kernels.fast_linear import FastQuantizedLinear, use_fast_quantized_linear

    model, _ = build_random_model("tiny", bits=4, seed=2)
    prompt = mx.array([[1, 5, 9, 2]])
    want = model(prompt)
    monkeypatch.setattr(fast_linear, "enabled", lambda: True)  # as on CUDA (the kernel calls fall back on CPU)
    assert use_fast_quantized_linear(model) == 0  # every tiny layer is below MIN_WEIGHT
    fuse_projections(model)
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert type(attn.o_proj) is FastQuantizedLinear and attn.o_proj.fuses_residual
    assert type(mlp.down_proj) is FastQuantizedLinear and mlp.down_proj.fuses_residual
    assert type(attn.q_proj) is nn.QuantizedLinear and type(mlp.gate_proj) is nn.QuantizedLinear
    assert mx.array_equal(model(prompt), want).item()


def test_the_kernels_serve_only_operands_they_take(monkeypatch):
    monkeypatch.setattr(fast_linear, "enabled", lambda: True)
    monkeypatch.setattr(hmv, "enabled", lambda hidden_size=None: True)
    for kwargs, kernel, half in [
        (dict(bits=4), True, False),
        (dict(bits=8), False, False),
        (dict(dtype="bfloat16"), False, True),
        (dict(dtype="float32"), False, False),
    ]:
        model, _ = build_random_model("tiny", seed=1, **kwargs)
        fast_linear.maybe_use_fast_quantized_linear(model)  # the layer swaps, as on CUDA
        fuse_projections(model)
        proj = model.layers[0].self_attn.fused_qkv
        assert (proj.kernel, proj.half_kernel) == (kernel, half), kwargs
