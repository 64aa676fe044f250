"""The final norm as our kernel while a decode step is recorded for a CUDA graph (rms_norm.py): which models get the
recordable norm, and that it is MLX's norm, bit for bit, everywhere outside a recording and on a machine without
the kernel; on CUDA, the kernel inside a recording against MLX's norm.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from test_qmv import needs_cuda

from mlxcel_core.backends import cpu_norm
from mlxcel_core.backends.cuda.kernels import rms_norm
from mlxcel_core.backends.cuda.kernels.rms_norm import (
    RecordableRMSNorm,
    final_norm_as_kernel,
    make_final_norm_recordable,
)
from mlxcel_core.loading.shapes import build_random_model
from mlxcel_core.models import model_class_for


def _build(**config):
    config = dict(
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=32,
        **config,
    )
    model_class, args_class = model_class_for(config)
    return model_class(args_class.from_dict(config))


def test_the_final_rmsnorm_becomes_recordable_with_its_parameters():
    model, _ = build_random_model("tiny", dtype="float32", seed=1)
    cpu_norm.unprepare(model)  # (the norms as a GPU process builds them: the CPU's compiled norm is not swapped in)
    norm = model.model.norm
    weight = norm.weight
    prompt = mx.array([[3, 1, 4, 1, 5]])
    want = model(prompt)
    make_final_norm_recordable(model)
    assert model.model.norm is norm and type(norm) is RecordableRMSNorm and isinstance(norm, nn.RMSNorm)
    assert norm.weight is weight and list(norm.parameters()) == ["weight"]
    assert mx.array_equal(model(prompt), want).item()
    make_final_norm_recordable(model)  # again: nothing changes
    assert type(norm) is RecordableRMSNorm
    assert all(type(layer.input_layernorm) is nn.RMSNorm for layer in model.layers)  # the final norm only


def test_other_final_norms_keep_their_classes():
    """Gemma's (1 + weight) RMSNorm is not nn.RMSNorm: the kernel computes weight * x, so it stays."""
    gemma = _build(model_type="gemma2", head_dim=16, query_pre_attn_scalar=16)
    kind = type(gemma.model.norm)
    make_final_norm_recordable(gemma)
    assert type(gemma.model.norm) is kind and kind is not nn.RMSNorm
    make_final_norm_recordable(nn.Linear(2, 2))  # no `model.norm`: nothing to do


@pytest.mark.skipif(bool(getattr(mx, "cuda", None) and mx.cuda.is_available()), reason="the kernel runs here")
def test_without_cuda_the_recording_context_is_mlx_norm(monkeypatch):
    model, _ = build_random_model("tiny", dtype="bfloat16", seed=2)
    prompt = mx.array([[3, 1, 4, 1, 5]])
    want = model(prompt)
    make_final_norm_recordable(model)
    monkeypatch.setattr(rms_norm, "rms_norm", lambda *a: pytest.fail("the kernel ran without CUDA"))
    with final_norm_as_kernel():
        got = model(prompt)
    assert mx.array_equal(got, want).item()


@needs_cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32], ids=["bf16", "fp16", "f32"])
def test_inside_a_recording_the_kernel_matches_mlx_norm(monkeypatch, dtype):
    """The kernel runs (and only inside the context), within one rounding of MLX's norm (the same arithmetic: on the
    H200 it gave the same logits bit for bit)."""
    norm = nn.RMSNorm(2048, eps=1e-5)
    norm.weight = mx.random.uniform(0.5, 1.5, (2048,), key=mx.random.key(0)).astype(dtype)
    x = (mx.random.normal((3, 1, 2048), key=mx.random.key(1)) * 3).astype(dtype)
    want = norm(x)
    norm.__class__ = RecordableRMSNorm
    calls, kernel = [], rms_norm.rms_norm
    monkeypatch.setattr(rms_norm, "rms_norm", lambda *a: calls.append(1) or kernel(*a))
    assert mx.array_equal(norm(x), want).item() and not calls
    with final_norm_as_kernel():
        got = norm(x)
    assert calls and got.dtype == dtype
    tol = {mx.bfloat16: 2.0**-7, mx.float16: 2.0**-10, mx.float32: 1e-6}[dtype]
    assert mx.allclose(got, want, rtol=tol, atol=tol).item(), mx.abs(got - want).max()
