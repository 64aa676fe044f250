"""The 16-bit decode matvec kernel (mlxcel_core/backends/cuda/kernels/hmv.py) and its layers (FastLinear,
FastEmbedding).

Everywhere: the shape predicate, launch layouts, the gate (models up to 4096 wide), the layer swap, and that the
swapped layers (and fused projections over them) compute MLX's values bit for bit where the kernel does not run.
CUDA only (skipped elsewhere): the kernel against float64 in every mode, a llama-3.2-1b bf16 decode with and
without it, and greedy tokens against a float32 stand-in. test_qmv_compile.py compiles its source for sm_90.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from test_fused_projections import assert_swiglu_close
from test_qmv import check_close, needs_cuda
from test_qmv_models import _check_model_agreement, rowwise_float32, switch_layers

from mlxcel_core.backends.cuda.kernels import fast_linear, hmv, qmv
from mlxcel_core.backends.cuda.kernels.fast_linear import (
    FastEmbedding,
    FastLinear,
    restore_quantized_linear,
    use_fast_half_linear,
)
from mlxcel_core.backends.cuda.kernels.fused_projections import fuse_projections
from mlxcel_core.loading.shapes import build_random_model


def test_shape_supported():
    bf, f16, f32 = mx.bfloat16, mx.float16, mx.float32
    assert hmv.shape_supported((1, 4096), bf, (4096, 4096), bf) and hmv.shape_supported((2, 4, 576), f32, (9, 576), f16)
    assert not hmv.shape_supported((1, 4096), bf, (4096, 4096), f32)  # float32 weights: MLX's matmul
    assert not hmv.shape_supported((1, 4100), bf, (8, 4100), bf)  # K not a multiple of 8
    assert not hmv.shape_supported((9, 4096), bf, (8, 4096), bf)  # more rows than one launch takes
    assert not hmv.shape_supported((1, 4096), bf, (8, 2048), bf) and not hmv.shape_supported((1, 8), bf, (8,), bf)


def test_launch_layouts():
    args = hmv.launch_args((2, 2048), mx.bfloat16, mx.bfloat16, 2048 + 2 * 512, mode="qkv", split=(2048, 512))
    assert args["output_shapes"] == [(2, 2048), (2, 512), (2, 512)] and args["output_dtypes"] == [mx.bfloat16] * 3
    rows, warps, _ = hmv.launch_config(3072, 2048, 2)
    assert args["grid"] == (-(-3072 // rows) * warps * 32, 1, 1) and dict(args["template"])["NQ"] == 2048
    args = hmv.launch_args((1, 2048), mx.float32, mx.bfloat16, 2 * 8192, mode="swiglu_norm", eps=1e-5)
    assert args["output_shapes"] == [(1, 8192)] and args["output_dtypes"] == [mx.float32]
    assert dict(args["template"])["EPS_BITS"] == 0x3727C5AC  # 1e-5 as float32: a constant, not a [1] input
    with pytest.raises(ValueError, match="epsilon"):
        hmv.launch_args((1, 2048), mx.float32, mx.bfloat16, 2 * 8192, mode="swiglu_norm")
    # GROUPS: 8 one-warp groups of 2 rows to a CUDA block; 1536 groups for 3072 rows, 192 blocks of 256 threads
    args = hmv.launch_args((1, 2048), mx.bfloat16, mx.bfloat16, 3072, (2, 1, 2, 8))
    assert args["grid"] == (192 * 256, 1, 1) and args["threadgroup"] == (256, 1, 1)
    cfg = dict(args["template"])["CFG"]
    assert cfg == qmv.pack_config(1, 0, 2, 1, 2, 8) and cfg >> 24 == 8
    assert qmv.unpack_launch((4, 2, 1)) == (4, 2, 1, 1)
    with pytest.raises(ValueError, match="at most 32 warps"):
        qmv.unpack_launch((2, 8, 1, 8))


def test_launch_rule_caps_the_swiglu_modes_at_four_warps():
    # 8B shapes: K = 4096 gives 8 warps of two 256-element rounds, but the gate/up launch was faster with 4 in the model
    assert hmv.launch_config(6144, 4096, 1, "qkv_norm_rope") == (2, 8, 2)
    assert hmv.launch_config(2 * 14336, 4096, 1, "swiglu_norm") == hmv.launch_config(2 * 14336, 4096, 1, "swiglu")
    assert hmv.launch_config(2 * 14336, 4096, 1, "swiglu") == (2, 4, 2)
    assert hmv.launch_config(2 * 8192, 2048, 1, "swiglu") == hmv.launch_config(2 * 8192, 2048, 1) == (2, 4, 2)
    args = hmv.launch_args((1, 4096), mx.bfloat16, mx.bfloat16, 2 * 14336, mode="swiglu_norm", eps=1e-5)
    assert args["threadgroup"] == (128, 1, 1) and args["grid"] == (14336 * 128, 1, 1)
    assert hmv.launch_args((9, 2048), mx.bfloat16, mx.bfloat16, 64) is None
    assert hmv.launch_args((1, 2048), mx.bfloat16, mx.float32, 64) is None


def test_gate(monkeypatch):
    cuda = qmv.cuda_kernel_available()
    # models up to DEFAULT_MAX_HIDDEN wide, on CUDA only
    assert [hmv.enabled(w) for w in (None, 2048, 4096, 4097, 8192)] == [False, cuda, cuda, False, False]
    monkeypatch.setattr(qmv, "cuda_kernel_available", lambda: True)
    assert [hmv.enabled(w) for w in (None, 2048, 4096, 4097, 8192)] == [False, True, True, False, False]
    monkeypatch.setattr(qmv, "cuda_kernel_available", lambda: False)
    assert not hmv.enabled(2048)


def test_the_default_asks_the_token_embedding_width():
    model, _ = build_random_model("tiny", dtype="bfloat16", seed=1)
    assert fast_linear.embedding_width(model) == 128
    model, _ = build_random_model("tiny", bits=4, seed=1)
    assert fast_linear.embedding_width(model) is None  # a 4-bit model: no 16-bit layers to swap


def _logits(model, prompt=(3, 1, 4, 1, 5)):
    return model(mx.array([list(prompt)]))


def test_swapped_layers_compute_mlx_values_where_the_kernel_does_not_run():
    if qmv.kernel_ready():  # (and a tiny model's layers come swapped already there)
        pytest.skip("with CUDA the kernel runs: see the CUDA tests")
    model, _ = build_random_model("tiny", dtype="bfloat16", seed=3)
    want = _logits(model)
    swapped = use_fast_half_linear(model)
    assert swapped == 7 * len(model.layers) + 2  # every projection, the embedding, the LM head
    assert type(model.lm_head) is FastLinear and type(model.model.embed_tokens) is FastEmbedding
    assert mx.array_equal(_logits(model), want).item()
    fuse_projections(model)  # fused projections over FastLinear layers, the residual marked
    assert model.layers[0].self_attn.fused_qkv is not None and model.layers[0].mlp.down_proj.fuses_residual
    assert mx.array_equal(_logits(model), want).item()
    assert restore_quantized_linear(model) == swapped and type(model.lm_head) is nn.Linear


# -- CUDA -----------------------------------------------------------------------------------------------------
def _operands(m, n, k, dtype, seed):
    x = mx.random.normal((m, k), key=mx.random.key(seed)).astype(dtype)
    w = (mx.random.normal((n, k), key=mx.random.key(seed + 1)) * 0.02).astype(dtype)
    return x, w


def _reference(x, w):
    x64, w64 = (np.array(a.astype(mx.float32), np.float64) for a in (x, w))
    return x64 @ w64.T, np.abs(x64) @ np.abs(w64).T


@needs_cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("n,k", [(4096, 4096), (14336, 4096), (4096, 14336), (1024, 512), (300, 584)])
def test_kernel_matches_float64(n, k, dtype):
    for m in (1, 2, 5, 8):
        x, w = _operands(m, n, k, dtype, seed=n + k + m)
        ref, mag = _reference(x, w)
        y = hmv.launch(hmv.launch_args(x.shape, x.dtype, w.dtype, n), x, w)
        assert y.dtype == dtype
        check_close(y, ref, mag, dtype, f"M={m} N={n} K={k}")


@needs_cuda
@pytest.mark.parametrize("m", [2, 8])  # 8: a decode batch of a model up to 2048 wide (fast_linear.half_rows)
@pytest.mark.parametrize("config", [None, (2, 1, 2, 8), (2, 2, 2, 4), (4, 1, 1, 4)], ids=str)
def test_modes(config, m):
    """Every base mode against float64, with the default launch and with several groups to a CUDA block."""
    k, nq, nk, inter = 2048, 2048, 512, 8192
    x, w = _operands(m, nq + 2 * nk, k, mx.bfloat16, seed=1)
    ref, mag = _reference(x, w)
    q, kk, v = hmv.launch(
        hmv.launch_args(x.shape, x.dtype, w.dtype, nq + 2 * nk, config, mode="qkv", split=(nq, nk)), x, w, "qkv"
    )
    check_close(mx.concatenate([q, kk, v], axis=-1), ref, mag, mx.bfloat16, "qkv")
    residual = mx.random.normal((m, nq + 2 * nk), key=mx.random.key(3)).astype(mx.bfloat16)
    plain = hmv.launch(hmv.launch_args(x.shape, x.dtype, w.dtype, nq + 2 * nk, config), x, w)
    check_close(plain, ref, mag, mx.bfloat16, "plain")
    fused = hmv.launch(
        hmv.launch_args(x.shape, x.dtype, w.dtype, nq + 2 * nk, config, mode="residual"), x, w, "residual", (residual,)
    )
    assert mx.array_equal(fused, residual + plain).item()
    x, w = _operands(m, 2 * inter, k, mx.bfloat16, seed=2)
    ref, _ = _reference(x, w)
    y = hmv.launch(hmv.launch_args(x.shape, x.dtype, w.dtype, 2 * inter, config, mode="swiglu"), x, w, "swiglu")
    assert_swiglu_close(y, ref, inter)


@needs_cuda
@pytest.mark.parametrize("config", [(2, 1, 2, 8), (2, 2, 2, 4)], ids=str)
def test_norm_and_rope_modes_with_groups_match_the_default_launch(config):
    """qkv_norm_rope and swiglu_norm with several groups to a CUDA block against the default launch (which
    test_fused_projections checks against float64 for the 4-bit kernel's same epilogues): within two bf16 ulps, the
    sums' order being the only difference."""
    m, k, nq, nk, hd, inter = 1, 2048, 2048, 512, 64, 8192
    g = mx.random.uniform(0.5, 1.5, (k,), key=mx.random.key(4)).astype(mx.bfloat16)
    positions = mx.array(np.array([100.0, 0.0, 0.0, 0.0], dtype=np.float32))[:m]
    inv_freq = mx.array((500000.0 ** -(np.arange(0, hd, 2) / hd)).astype(np.float32))
    x, w = _operands(m, nq + 2 * nk, k, mx.bfloat16, seed=5)
    x = x.reshape(1, 1, k)
    outs = [
        hmv.launch(
            hmv.launch_args(
                x.shape, x.dtype, w.dtype, nq + 2 * nk, c, mode="qkv_norm_rope", split=(nq, nk, hd), eps=1e-5
            ),
            x,
            w,
            "qkv_norm_rope",
            (g, positions, inv_freq),
        )
        for c in (None, config)
    ]
    x2, w2 = _operands(m, 2 * inter, k, mx.bfloat16, seed=6)
    outs += [
        [
            hmv.launch(
                hmv.launch_args(x2.shape, x2.dtype, w2.dtype, 2 * inter, c, mode="swiglu_norm", eps=1e-5),
                x2,
                w2,
                "swiglu_norm",
                (g,),
            )
        ]
        for c in (None, config)
    ]
    for want, got in ((outs[0], outs[1]), (outs[2], outs[3])):
        for a, b in zip(want, got):
            a32, b32 = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
            assert a32.shape == b32.shape
            assert np.all(np.abs(a32 - b32) <= 2.0**-7 * np.abs(a32) + 2.0**-8 * np.abs(a32).mean())


@needs_cuda
def test_model_decode_with_the_kernel_agrees(monkeypatch):
    """llama-3.2-1b bf16, the same weights with the kernel and with MLX's layers (`hmv.enabled` off; fused projections
    either way): logits of a prefill and three decode steps within 0.25 x their std (the bf16 tolerance of the 4-bit
    kernel's model tests: MLX's bf16 GEMV rounds differently from this kernel's float32 sums)."""
    from test_fused_projections import _decode_logits

    runs, models = {}, {}
    on = hmv.enabled
    for kernel in (True, False):
        monkeypatch.setattr(hmv, "enabled", on if kernel else lambda hidden_size=None: False)
        model, _ = build_random_model("llama-3.2-1b", dtype="bfloat16", seed=7)
        models[kernel] = model
        assert (type(model.layers[0].mlp.down_proj) is FastLinear) == kernel
        runs[kernel] = np.concatenate([np.array(_decode_logits(model, batch).astype(mx.float32)) for batch in (1, 2)])
    assert np.isfinite(runs[True]).all()
    assert np.abs(runs[True] - runs[False]).max() <= 0.25 * runs[False].std()
    # batch 2 took the kernel too (the kernel model's layer: the other model's is MLX's Linear)
    assert models[True].layers[0].mlp.down_proj.kernel_rows >= 2


@needs_cuda
def test_model_decode_of_eight_rows_agrees(monkeypatch):
    """The same at a decode batch of 8 (the rows a call of models up to 2048 wide, fast_linear.half_rows): q/k/v,
    gate/up and the residual projections of 8 rows on the kernel."""
    from test_fused_projections import _decode_logits

    runs = {}
    on = hmv.enabled
    for kernel in (True, False):
        monkeypatch.setattr(hmv, "enabled", on if kernel else lambda hidden_size=None: False)
        model, _ = build_random_model("llama-3.2-1b", dtype="bfloat16", seed=7)
        if kernel:
            assert model.layers[0].mlp.down_proj.kernel_rows == 8
        runs[kernel] = np.array(_decode_logits(model, 8).astype(mx.float32))
    assert np.isfinite(runs[True]).all()
    assert np.abs(runs[True] - runs[False]).max() <= 0.25 * runs[False].std()


# -- CUDA: greedy decoding against a float32 stand-in --------------------------------------------------------
def _accurate(weight: mx.array, x: mx.array) -> mx.array:
    return rowwise_float32(weight, x, mx.result_type(x, weight))


class _AccurateLinear(nn.Linear):
    def __call__(self, x):
        if x.size > hmv.MAX_ROWS * x.shape[-1]:
            return super().__call__(x)
        y = _accurate(self["weight"], x)
        return y + self["bias"] if "bias" in self else y


class _AccurateEmbedding(nn.Embedding):
    def as_linear(self, x):
        return super().as_linear(x) if x.size > hmv.MAX_ROWS * x.shape[-1] else _accurate(self["weight"], x)


_HALF_LAYERS = {
    "mlx": (nn.Linear, nn.Embedding),
    "kernel": (FastLinear, FastEmbedding),
    "accurate": (_AccurateLinear, _AccurateEmbedding),
}


def _use_half(model, kind):
    """Give every 16-bit layer of `model` (of the classes above) the classes of `kind`."""
    switch_layers(model, _HALF_LAYERS, kind)


@needs_cuda
@pytest.mark.parametrize("shape", ["tiny", "llama-3.2-1b"])
def test_greedy_bfloat16_vs_float32_matvec(shape):
    """The greedy tokens of a random bf16 model with the kernel against the float32 stand-in: identical but at
    near-ties (test_qmv._check_model_agreement), as the 4-bit kernel's bf16 test."""
    model, _ = build_random_model(shape, dtype="bfloat16", seed=1)
    _check_model_agreement(model, f"{shape} bfloat16", 16, rel_tol=0.25, reference="accurate", use=_use_half)
