"""The RMSNorm and RoPE folds of the fused decode projections (fused_projections.py, rope_fold.py): the kernel's
"_norm" and "_rope" modes against float64 references (CUDA), their emulations against MLX's norm and rope (everywhere),
where a fold applies, the RoPE fold's frequencies and positions, and a 1B model's decode with each fold on against off
(CUDA).
"""

from __future__ import annotations

import re
import tempfile

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from test_fused_projections import _decode_logits, assert_swiglu_close
from test_qmv import check_close, make_operands, needs_cuda, reference

from mlxcel_core.backends import cpu_norm
from mlxcel_core.backends.cuda.kernels import qmv, rope_fold
from mlxcel_core.backends.cuda.kernels.fused_projections import fuse_projections
from mlxcel_core.backends.cuda.kernels.rope_fold import fold_frequencies, fold_positions
from mlxcel_core.loading.shapes import build_random_model


# -- the RMSNorm taken into the q/k/v and gate/up launches (modes "qkv_norm", "swiglu_norm") ----------------------
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


def test_norm_fold_needs_an_rmsnorm_and_the_kernel():
    model, _ = build_random_model("tiny", bits=4, seed=4)
    cpu_norm.unprepare(model)  # (the norms as a GPU process builds them: the CPU's compiled norm is not swapped in)
    fuse_projections(model)
    proj, norm = model.layers[0].self_attn.fused_qkv, model.layers[0].input_layernorm
    assert proj.fold_norm == bool(proj.kernel or proj.half_kernel)  # only where a kernel runs the launch
    proj.fold_norm = False
    assert proj._norm_inputs(norm) is None
    proj.fold_norm = True
    weight, eps = proj._norm_inputs(norm)
    assert weight is norm.weight and eps == norm.eps  # eps: a constant of the launch, no [1] input array
    assert proj._norm_inputs(nn.LayerNorm(norm.weight.shape[0])) is None


@pytest.mark.parametrize("flag", ["fold_norm", "fold_rope"])
@pytest.mark.skipif(qmv.cuda_kernel_available(), reason="the kernel runs here: the fold tests below cover it")
def test_folds_compute_the_same_values_where_the_kernel_does_not_run(flag):
    """A fold switched on without a kernel: the blocks pass their norms (and positions) to the fused projections,
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
def test_model_decode_with_folded_norms_agrees():
    """llama-3.2-1b 4-bit bf16: folded norms against separate ones."""
    model, _ = build_random_model("llama-3.2-1b", bits=4, dtype="bfloat16", seed=7)
    fuse_projections(model)  # (none left to fuse where the backend's prepare step fused them)
    _assert_fold_agrees(model, "fold_norm", lambda layer: (layer.self_attn.fused_qkv, layer.mlp.fused_gate_up))


# -- RoPE applied to q and k in the q/k/v launch (modes "qkv_rope", "qkv_norm_rope") ------------------------------
def _rope_epilogue(
    products: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, nq: int, nk: int, hd: int
) -> np.ndarray:
    """The kernel's rope epilogue in numpy: each (row, row + hd/2) pair of a head rounded to bf16, then rotated in
    float32 for q and k rows (v's pass through), then rounded to bf16. products [M, NQ + 2 NK] (float64)."""

    def bf16(a):
        return np.array(mx.array(a.astype(np.float32)).astype(mx.bfloat16).astype(mx.float32))

    out = bf16(products).copy()
    half = hd // 2
    for head in range((nq + nk) // hd):
        a = out[:, head * hd : head * hd + half].copy()
        b = out[:, head * hd + half : (head + 1) * hd].copy()
        angle = (positions[:, None] * inv_freq[None]).astype(np.float32)
        c, s = np.cos(angle, dtype=np.float32), np.sin(angle, dtype=np.float32)
        out[:, head * hd : head * hd + half] = a * c - b * s
        out[:, head * hd + half : (head + 1) * hd] = b * c + a * s
    return bf16(out)


@pytest.mark.parametrize("offset,scale", [(0, 1.0), (37, 1.0), (1000, 0.25)])
def test_emulated_rope_epilogue_is_mlx_rope_of_the_rounded_products(offset, scale):
    from mlxcel_core.models.rope import RoPE

    m, nq, nk, hd = 3, 4 * 32, 2 * 32, 32
    rng = np.random.default_rng(offset)
    products = rng.standard_normal((m, nq + 2 * nk))
    rope = RoPE(hd, 10000.0, scale=scale)
    positions = np.array(fold_positions(offset, m, 1, scale))  # three sequences at the same position
    got = _rope_epilogue(products, positions, np.array(fold_frequencies(rope, hd)), nq, nk, hd)
    rounded = mx.array(products.astype(np.float32)).astype(mx.bfloat16)
    q = rounded[:, :nq].reshape(m, 1, nq // hd, hd).transpose(0, 2, 1, 3)
    k = rounded[:, nq : nq + nk].reshape(m, 1, nk // hd, hd).transpose(0, 2, 1, 3)
    want_q = np.array(rope(q, offset).transpose(0, 2, 1, 3).reshape(m, nq).astype(mx.float32))
    want_k = np.array(rope(k, offset).transpose(0, 2, 1, 3).reshape(m, nk).astype(mx.float32))
    ulp = 2.0**-7 * np.abs(want_q).max()
    assert np.abs(got[:, :nq] - want_q).max() <= ulp and np.abs(got[:, nq : nq + nk] - want_k).max() <= ulp
    assert np.array_equal(got[:, nq + nk :], np.array(rounded[:, nq + nk :].astype(mx.float32)))  # v unrotated


def test_rope_pairs_cover_every_row_once():
    """The kernel's pair row map: pair p -> rows (p // (hd/2)) * hd + p % (hd/2) and that + hd/2."""
    nq, nk, hd = 6 * 64, 2 * 64, 64
    rows = []
    for p in range((nq + 2 * nk) // 2):
        n = (p // (hd // 2)) * hd + p % (hd // 2)
        rows += [n, n + hd // 2]
    assert sorted(rows) == list(range(nq + 2 * nk))


def test_rope_fold_frequencies():
    from mlxcel_core.models.rope import LongRoPE, RoPE

    base = fold_frequencies(RoPE(64, 500000.0), 64)
    assert base.dtype == mx.float32 and np.allclose(np.array(base), 500000.0 ** -(np.arange(0, 64, 2) / 64))
    custom = mx.array(np.linspace(1.0, 0.01, 32).astype(np.float32))
    assert np.allclose(np.array(fold_frequencies(RoPE(64, 1.0, inv_freq=custom), 64)), np.array(custom), rtol=1e-6)
    assert fold_frequencies(RoPE(64, 1e4, traditional=True), 64) is None
    assert fold_frequencies(RoPE(32, 1e4), 64) is None  # a partial rotation
    assert fold_frequencies(RoPE(64, 1e4, mscale=1.2), 64) is None
    scaling = {
        "rope_type": "longrope",
        "original_max_position_embeddings": 64,
        "factor": 2.0,
        "short_factor": [1.0] * 32,
        "long_factor": [2.0] * 32,
    }
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
        norm_args = qmv.launch_args(
            x.shape, x.dtype, scales.dtype, nq + 2 * nk, 64, mode="qkv_norm", split=(nq, nk), eps=1e-5
        )
        normed = mx.concatenate(qmv.launch(norm_args, x, w, scales, biases, "qkv_norm", extra), axis=-1)
        ref = np.array(normed.astype(mx.float32)).astype(np.float64)
    positions = mx.array(np.arange(m, dtype=np.float32) * 7 + 100)
    inv_freq = mx.array((500000.0 ** -(np.arange(0, hd, 2) / hd)).astype(np.float32))
    args = qmv.launch_args(
        x.shape, x.dtype, scales.dtype, nq + 2 * nk, 64, mode=mode, split=(nq, nk, hd), eps=1e-5 if extra else None
    )
    q, kk, v = qmv.launch(args, x, w, scales, biases, mode, (*extra, positions, inv_freq))
    got = np.array(mx.concatenate([q, kk, v], axis=-1).astype(mx.float32))
    want = _rope_epilogue(ref, np.array(positions), np.array(inv_freq), nq, nk, hd)
    # two bf16 ulps: the products' own rounding may differ by one where float32 sums straddle a boundary
    assert np.all(np.abs(got - want) <= 2.0**-7 * np.abs(want) + 2.0**-8 * np.abs(want).mean())


@needs_cuda
def test_model_decode_with_rope_folded_agrees():
    """llama-3.2-1b 4-bit bf16 (llama3 RoPE scaling: custom frequencies): folded against separate rotations."""
    model, _ = build_random_model("llama-3.2-1b", bits=4, dtype="bfloat16", seed=7)
    fuse_projections(model)
    _assert_fold_agrees(model, "fold_rope", lambda layer: (layer.self_attn.fused_qkv,))


# -- the RoPE fold's positions and frequencies (rope_fold.py) ---------------------------------------------------
def test_fold_positions_is_computed_once_per_offset_array():
    """Every layer of a decode step passes the same offset array: the second call returns the first's result; another
    array (the next step's), or another shape or scale, is computed afresh, with the right values."""

    offset = mx.array([7, 3], dtype=mx.int32)
    first = fold_positions(offset, 2, 1, 0.5)
    assert fold_positions(offset, 2, 1, 0.5) is first
    assert first.tolist() == [3.5, 1.5]
    assert fold_positions(offset, 2, 1, 1.0).tolist() == [7.0, 3.0]
    same_values = mx.array([7, 3], dtype=mx.int32)
    again = fold_positions(same_values, 2, 1, 0.5)
    assert again is not first and again.tolist() == [3.5, 1.5]
    assert fold_positions(mx.array([9, 4], dtype=mx.int32), 2, 2, 1.0).tolist() == [9.0, 10.0, 4.0, 5.0]
    assert fold_positions(5, 1, 2, 1.0).tolist() == [5.0, 6.0]


@pytest.mark.parametrize("batch,length", [(1, 1), (2, 1), (3, 1), (1, 2), (1, 3), (2, 2), (5, 1), (1, 7), (3, 4)])
@pytest.mark.parametrize("shared", [False, True])
def test_fold_positions_small_steps_give_row_major_positions(batch, length, shared):
    """Under 4 positions the values come from a padded 16-byte array (a view of it): the same row-major
    [batch * length] values as the plain formula, for one offset per row or one shared by all."""

    starts = [11] * batch if shared else [11 + 5 * b for b in range(batch)]
    offset = mx.array(starts[:1] if shared else starts, dtype=mx.int32)
    got = fold_positions(offset, batch, length, 0.25)
    want = [(s + t) * 0.25 for s in starts for t in range(length)]
    assert got.dtype == mx.float32 and got.shape == (batch * length,) and got.tolist() == want
    assert fold_positions(11, batch, length, 0.25).tolist() == [
        (11 + t) * 0.25 for _ in range(batch) for t in range(length)
    ]


@needs_cuda
@pytest.mark.parametrize("batch,length", [(1, 1), (2, 1), (3, 1), (5, 1), (64, 1), (1, 2), (1, 7), (3, 4), (2, 300)])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("scale", [1.0, 0.25, 1 / 3])
def test_positions_kernel_gives_the_ops_values_bit_for_bit(batch, length, shared, scale):
    """The positions kernel against the MLX ops it replaces (whose fused elementwise graph MLX compiles with NVRTC the
    first time a machine runs it): the same float32 bits, from a padded array of at least 16 bytes."""
    rng = np.random.default_rng(batch * 1000 + length)
    offset = mx.array(rng.integers(0, 200_000, size=1 if shared else batch), dtype=mx.int32)
    got = rope_fold._kernel_positions(offset, batch, length, scale)
    want = rope_fold._op_positions(offset, batch, length, scale)
    assert got.shape == want.shape == (batch * length,)
    assert np.array(got).view(np.uint32).tolist() == np.array(want).view(np.uint32).tolist()


def test_fold_positions_ramp_is_a_constant_inside_a_compiled_step():
    """The 0..n-1 ramp is made and evaluated once (no arange op in each step's graph), and a compiled step that
    computes positions from its offset input gives the eager values, step after step."""
    rope_fold._ramp.cache_clear()  # first made inside the trace below, as in a compiled decode step

    def step(offset):
        rope_fold._last_positions = None  # each traced call computes afresh
        return fold_positions(offset, 1, 1, 0.5) * 1.0

    compiled = mx.compile(step)
    for value in (7, 8, 300):
        offset = mx.array([value], dtype=mx.int32)
        assert compiled(offset).tolist() == step(offset).tolist() == [value * 0.5]
    assert rope_fold._ramp(4) is rope_fold._ramp(4) and rope_fold._ramp(4).tolist() == [0.0, 1.0, 2.0, 3.0]


def test_fold_frequencies_are_evaluated_constants():
    """Made once per RoPE and already evaluated, so a compiled step holds them as a constant (no op per step)."""
    from mlxcel_core.models.rope import RoPE

    rope = RoPE(64, 10000.0, inv_freq=mx.array(np.linspace(1.0, 0.01, 32).astype(np.float32)))
    step = mx.compile(lambda x: x * fold_frequencies(rope, 64))
    out = step(mx.ones(32))
    assert fold_frequencies(rope, 64) is rope._fold_inv_freq
    with tempfile.TemporaryDirectory() as tmp:
        mx.export_to_dot(f"{tmp}/g.dot", out)
        ops = re.findall(r'label\s*=\s*"(\w+)"', open(f"{tmp}/g.dot").read())
    assert "Divide" not in ops and ops.count("Multiply") == 1, ops
