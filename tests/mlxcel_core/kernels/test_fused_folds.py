"""The RMSNorm and RoPE folds of the fused decode projections (MLXCEL_FUSE_NORM, MLXCEL_FUSE_ROPE): the kernel's
"_norm" and "_rope" modes against float64 references (CUDA), their emulations against MLX's norm and rope (everywhere),
the gates, and a 1B model's decode with each fold on against off (CUDA).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from test_fused_projections import _decode_logits, assert_swiglu_close
from test_qmv import check_close, make_operands, needs_cuda, reference

from mlxcel_core.kernels import fused_projections, qmv
from mlxcel_core.kernels.fused_projections import fuse_projections
from mlxcel_core.models.shapes import build_random_model


# -- the RMSNorm taken into the q/k/v and gate/up launches (MLXCEL_FUSE_NORM=1; modes "qkv_norm", "swiglu_norm") --
def _rms_norm_reference(x, g, eps):
    """rms_norm(x) * g in float64 (numpy), from the same float32 values the kernel reads."""
    x64 = np.array(x.astype(mx.float32), np.float64)
    r = 1 / np.sqrt((x64**2).mean(-1, keepdims=True) + eps)
    return x64 * r * np.array(g.astype(mx.float32), np.float64)


@pytest.mark.parametrize("m,n,k", [(1, 64, 4096), (2, 48, 2048), (5, 40, 576)])
def test_emulated_norm_fold_matches_norm_then_matvec(m, n, k):
    """The kernel's algebra for a folded norm, in numpy float32: W (g x) summed with the kernel's arithmetic, then
    scaled by r = rsqrt(mean(x^2) + eps) -- against float64 rms_norm then matvec."""
    from test_qmv import ATOL_MAG, emulate_kernel

    x, w, scales, biases = make_operands(m, n, k, mx.bfloat16, seed=k)
    x = x * 3.0  # a hidden state's scale, not a normalized one
    g = (mx.random.uniform(0.5, 1.5, (k,), key=mx.random.key(k))).astype(mx.bfloat16)
    eps = 1e-5
    xg = np.array(x.astype(mx.float32)) * np.array(g.astype(mx.float32))
    sq = (np.array(x.astype(mx.float32)) ** 2).sum(-1, dtype=np.float32)
    r = 1 / np.sqrt(sq / np.float32(k) + np.float32(eps), dtype=np.float32)
    got = emulate_kernel(mx.array(xg), w, scales, biases, 64) * r[:, None]
    normed = _rms_norm_reference(x, g, eps)
    ref, mag = reference(mx.array(normed.astype(np.float32)), w, scales, biases)
    err = np.abs(got - ref) / mag
    assert err.max() <= ATOL_MAG[mx.bfloat16], f"{err.max():.3g} of |x| @ |W|.T"


def test_norm_fold_needs_the_gate_an_rmsnorm_and_the_kernel():
    model, _ = build_random_model("tiny", bits=4, seed=4)
    fuse_projections(model)
    proj, norm = model.layers[0].self_attn.fused_qkv, model.layers[0].input_layernorm
    assert proj.fold_norm == bool(proj.kernel or proj.half_kernel)  # only where a kernel runs the launch
    proj.fold_norm = False
    assert proj._norm_inputs(norm) is None
    proj.fold_norm = True
    weight, eps = proj._norm_inputs(norm)
    assert weight is norm.weight and eps == norm.eps  # eps: a constant of the launch, no [1] input array
    assert proj._norm_inputs(nn.LayerNorm(norm.weight.shape[0])) is None


@pytest.mark.parametrize("env,gate", [("MLXCEL_FUSE_NORM", "norm_fusion_enabled"),
                                      ("MLXCEL_FUSE_ROPE", "rope_fusion_enabled")])
def test_fold_gates_are_on_unless_set_to_zero(monkeypatch, env, gate):
    monkeypatch.delenv(env, raising=False)
    assert getattr(fused_projections, gate)()
    monkeypatch.setenv(env, "0")
    assert not getattr(fused_projections, gate)()
    monkeypatch.setenv(env, "1")
    assert getattr(fused_projections, gate)()


@pytest.mark.parametrize("flag", ["fold_norm", "fold_rope"])
@pytest.mark.skipif(qmv.cuda_kernel_available(), reason="the kernel runs here: the fold tests below cover it")
def test_folds_compute_the_same_values_where_the_kernel_does_not_run(flag):
    """A fold switched on without a kernel: the layers pass their norms (and positions) to the fused projections,
    which decline to fold, and the block normalizes / rotates exactly as before."""
    model, _ = build_random_model("tiny", bits=4, seed=6)
    want = [_decode_logits(model, batch) for batch in (1, 2)]
    fuse_projections(model)
    for layer in model.layers:
        for proj in (layer.self_attn.fused_qkv, layer.mlp.fused_gate_up):
            setattr(proj, flag, True)
    qkv = model.layers[0].self_attn.fused_qkv
    assert qkv.split_roped(mx.zeros((1, 1, 128)), None, mx.zeros((1,)), mx.zeros((16,)), 32) is None
    for batch, logits in zip((1, 2), want):
        assert mx.array_equal(_decode_logits(model, batch), logits).item()


@needs_cuda
@pytest.mark.parametrize("m", [1, 2, 5])
@pytest.mark.parametrize("mode", ["qkv_norm", "swiglu_norm"])
def test_norm_modes_match_rms_norm_then_matvec(mode, m):
    k, nq, nk, inter = 2048, 2048, 512, 8192
    n = nq + 2 * nk if mode == "qkv_norm" else 2 * inter
    x, w, scales, biases = make_operands(m, n, k, mx.bfloat16, seed=m)
    x = x * 3.0
    g = (mx.random.uniform(0.5, 1.5, (k,), key=mx.random.key(m))).astype(mx.bfloat16)
    normed = _rms_norm_reference(x, g, 1e-5)
    ref, mag = reference(mx.array(normed.astype(np.float32)), w, scales, biases)
    split = (nq, nk) if mode == "qkv_norm" else None
    args = qmv.launch_args(x.shape, x.dtype, scales.dtype, n, 64, mode=mode, split=split, eps=1e-5)
    out = qmv.launch(args, x, w, scales, biases, mode, (g,))
    if mode == "qkv_norm":
        check_close(mx.concatenate(out, axis=-1), ref, mag, mx.bfloat16, mode)
        return
    assert_swiglu_close(out, ref, inter)


def _assert_fold_agrees(model, flag: str, projections) -> None:
    """Decode logits (batch 1 and 2) with `flag` on every fused projection in `projections` (a function of a layer)
    against the same with it off: within 0.25 x their std, the tolerance of the kernel's bf16 model tests (a fold
    skips a bf16 rounding of the activations, or rounds the rotation differently)."""
    def set_flag(on: bool):
        for layer in model.layers:
            for proj in projections(layer):
                setattr(proj, flag, on)

    assert all(getattr(proj, flag) for proj in projections(model.layers[0]))
    for batch in (1, 2):
        folded = np.array(_decode_logits(model, batch).astype(mx.float32))
        set_flag(False)
        separate = np.array(_decode_logits(model, batch).astype(mx.float32))
        set_flag(True)
        assert np.isfinite(folded).all()
        assert np.abs(folded - separate).max() <= 0.25 * separate.std(), np.abs(folded - separate).max()


@needs_cuda
def test_model_decode_with_folded_norms_agrees(monkeypatch):
    """llama-3.2-1b 4-bit bf16: folded norms against separate ones."""
    monkeypatch.setenv("MLXCEL_QMV", "1")
    monkeypatch.setenv("MLXCEL_FUSE_NORM", "1")
    model, _ = build_random_model("llama-3.2-1b", bits=4, dtype="bfloat16", seed=7)
    _assert_fold_agrees(model, "fold_norm", lambda layer: (layer.self_attn.fused_qkv, layer.mlp.fused_gate_up))


# -- RoPE applied to q and k in the q/k/v launch (MLXCEL_FUSE_ROPE=1; modes "qkv_rope", "qkv_norm_rope") -----------
def _rope_epilogue(products: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, nq: int, nk: int,
                   hd: int) -> np.ndarray:
    """The kernel's rope epilogue in numpy: each (row, row + hd/2) pair of a head rounded to bf16, then rotated in
    float32 for q and k rows (v's pass through), then rounded to bf16. products [M, NQ + 2 NK] (float64)."""
    def bf16(a):
        return np.array(mx.array(a.astype(np.float32)).astype(mx.bfloat16).astype(mx.float32))

    out = bf16(products).copy()
    half = hd // 2
    for head in range((nq + nk) // hd):
        a = out[:, head * hd:head * hd + half].copy()
        b = out[:, head * hd + half:(head + 1) * hd].copy()
        angle = (positions[:, None] * inv_freq[None]).astype(np.float32)
        c, s = np.cos(angle, dtype=np.float32), np.sin(angle, dtype=np.float32)
        out[:, head * hd:head * hd + half] = a * c - b * s
        out[:, head * hd + half:(head + 1) * hd] = b * c + a * s
    return bf16(out)


@pytest.mark.parametrize("offset,scale", [(0, 1.0), (37, 1.0), (1000, 0.25)])
def test_emulated_rope_epilogue_is_mlx_rope_of_the_rounded_products(offset, scale):
    from mlxcel_core.models.rope import RoPE, fold_frequencies, fold_positions

    m, nq, nk, hd = 3, 4 * 32, 2 * 32, 32
    rng = np.random.default_rng(offset)
    products = rng.standard_normal((m, nq + 2 * nk))
    rope = RoPE(hd, 10000.0, scale=scale)
    positions = np.array(fold_positions(offset, m, 1, scale))  # three sequences at the same position
    got = _rope_epilogue(products, positions, np.array(fold_frequencies(rope, hd)), nq, nk, hd)
    rounded = mx.array(products.astype(np.float32)).astype(mx.bfloat16)
    q = rounded[:, :nq].reshape(m, 1, nq // hd, hd).transpose(0, 2, 1, 3)
    k = rounded[:, nq:nq + nk].reshape(m, 1, nk // hd, hd).transpose(0, 2, 1, 3)
    want_q = np.array(rope(q, offset).transpose(0, 2, 1, 3).reshape(m, nq).astype(mx.float32))
    want_k = np.array(rope(k, offset).transpose(0, 2, 1, 3).reshape(m, nk).astype(mx.float32))
    ulp = 2.0**-7 * np.abs(want_q).max()
    assert np.abs(got[:, :nq] - want_q).max() <= ulp and np.abs(got[:, nq:nq + nk] - want_k).max() <= ulp
    assert np.array_equal(got[:, nq + nk:], np.array(rounded[:, nq + nk:].astype(mx.float32)))  # v unrotated


def test_rope_pairs_cover_every_row_once():
    """The kernel's pair row map: pair p -> rows (p // (hd/2)) * hd + p % (hd/2) and that + hd/2."""
    nq, nk, hd = 6 * 64, 2 * 64, 64
    rows = []
    for p in range((nq + 2 * nk) // 2):
        n = (p // (hd // 2)) * hd + p % (hd // 2)
        rows += [n, n + hd // 2]
    assert sorted(rows) == list(range(nq + 2 * nk))


def test_rope_fold_frequencies():
    from mlxcel_core.models.rope import LongRoPE, RoPE, fold_frequencies

    base = fold_frequencies(RoPE(64, 500000.0), 64)
    assert base.dtype == mx.float32 and np.allclose(np.array(base), 500000.0 ** -(np.arange(0, 64, 2) / 64))
    custom = mx.array(np.linspace(1.0, 0.01, 32).astype(np.float32))
    assert np.allclose(np.array(fold_frequencies(RoPE(64, 1.0, inv_freq=custom), 64)), np.array(custom), rtol=1e-6)
    assert fold_frequencies(RoPE(64, 1e4, traditional=True), 64) is None
    assert fold_frequencies(RoPE(32, 1e4), 64) is None  # a partial rotation
    assert fold_frequencies(RoPE(64, 1e4, mscale=1.2), 64) is None
    scaling = {"rope_type": "longrope", "original_max_position_embeddings": 64, "factor": 2.0,
               "short_factor": [1.0] * 32, "long_factor": [2.0] * 32}
    assert fold_frequencies(LongRoPE(64, 1e4, False, scaling), 64) is None


@needs_cuda
@pytest.mark.parametrize("m", [1, 2, 5])
@pytest.mark.parametrize("mode", ["qkv_rope", "qkv_norm_rope"])
def test_rope_modes_match_products_then_rope(mode, m):
    k, nq, nk, hd = 2048, 2048, 512, 64
    x, w, scales, biases = make_operands(m, nq + 2 * nk, k, mx.bfloat16, seed=m)
    extra = ()
    if mode == "qkv_rope":
        ref, _ = reference(x, w, scales, biases)
    else:
        # The rotation's check, against the norm mode's own products (test_norm_modes_match_rms_norm_then_matvec
        # checks those against float64): both launches share the main loop, so the rope epilogue sees the same
        # float32 sums.
        g = mx.random.uniform(0.5, 1.5, (k,), key=mx.random.key(m)).astype(mx.bfloat16)
        extra = (g,)
        norm_args = qmv.launch_args(x.shape, x.dtype, scales.dtype, nq + 2 * nk, 64, mode="qkv_norm", split=(nq, nk),
                                    eps=1e-5)
        normed = mx.concatenate(qmv.launch(norm_args, x, w, scales, biases, "qkv_norm", extra), axis=-1)
        ref = np.array(normed.astype(mx.float32)).astype(np.float64)
    positions = mx.array(np.arange(m, dtype=np.float32) * 7 + 100)
    inv_freq = mx.array((500000.0 ** -(np.arange(0, hd, 2) / hd)).astype(np.float32))
    args = qmv.launch_args(x.shape, x.dtype, scales.dtype, nq + 2 * nk, 64, mode=mode, split=(nq, nk, hd),
                           eps=1e-5 if extra else None)
    q, kk, v = qmv.launch(args, x, w, scales, biases, mode, (*extra, positions, inv_freq))
    got = np.array(mx.concatenate([q, kk, v], axis=-1).astype(mx.float32))
    want = _rope_epilogue(ref, np.array(positions), np.array(inv_freq), nq, nk, hd)
    # two bf16 ulps: the products' own rounding may differ by one where float32 sums straddle a boundary
    assert np.all(np.abs(got - want) <= 2.0**-7 * np.abs(want) + 2.0**-8 * np.abs(want).mean())


@needs_cuda
def test_model_decode_with_rope_folded_agrees(monkeypatch):
    """llama-3.2-1b 4-bit bf16 (llama3 RoPE scaling: custom frequencies): folded against separate rotations."""
    monkeypatch.setenv("MLXCEL_QMV", "1")
    monkeypatch.setenv("MLXCEL_FUSE_ROPE", "1")
    model, _ = build_random_model("llama-3.2-1b", bits=4, dtype="bfloat16", seed=7)
    _assert_fold_agrees(model, "fold_rope", lambda layer: (layer.self_attn.fused_qkv,))
