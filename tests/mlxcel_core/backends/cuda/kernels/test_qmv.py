"""The 4-bit decode matvec kernel (mlxcel_core/kernels/qmv.py); the layer swap (kernels/fast_linear.py) in
test_fast_linear.py.

Everywhere: MLX's packing (element j of a uint32 in bits [4j, 4j+4)), the kernel's arithmetic emulated in
numpy float32 against mx.dequantize (magic-number dequantization, offsets, the per-group algebra), the shape
predicate, the fallback (== mx.quantized_matmul bit for bit), the launch arguments and configurations
(test_qmv_compile.py: that the source MLX would assemble compiles for sm_90 without register spills).
CUDA only (skipped elsewhere):
    python -m pytest -q tests/mlxcel_core/kernels
the kernel against x @ mx.dequantize(w).T computed in float64 (from float32 dequantized weights), for M in
{1, 2, 4, 8}, (N, K) in {(4096, 4096), (14336, 4096), (4096, 14336), (1024, 512)}, bf16 and fp16, random and
adversarial values; every launch configuration; odd shapes, group sizes 32/128, float32 and mixed dtypes, 1-D and
3-D, misaligned and non-contiguous inputs. Whole models (greedy decoding against a float32 matvec):
test_qmv_models.py.
Acceptance: |y - ref| <= rtol * |ref| + atol * (|x| @ |W|.T) elementwise, rtol = one unit of the output's last
place (2^-8 bf16, 2^-11 fp16, 1e-6 fp32), atol 2e-5 (fp16/bf16 outputs) or 1e-6 (float32 outputs, whose offsets
are removed exactly): the output's own rounding plus float32 accumulation error (the emulation measures <= 5e-6
and <= 1.4e-7 of |x| @ |W|.T).
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np
import pytest

from mlxcel_core.backends.cuda.kernels import qmv
from mlxcel_core.backends.cuda.kernels.qmv import (
    cuda_kernel_available,
    cuda_quantized_matvec,
    launch_config,
    quantized_matvec,
    shape_supported,
    supports,
)

needs_cuda = pytest.mark.skipif(not cuda_kernel_available(), reason="needs MLX's CUDA backend and a CUDA device")

RTOL = {mx.bfloat16: 2.0**-8, mx.float16: 2.0**-11, mx.float32: 1e-6}
ATOL_MAG = {mx.bfloat16: 2e-5, mx.float16: 2e-5, mx.float32: 1e-6}  # times |x| @ |W|.T
DECODE_SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (1024, 512)]  # (N, K)


# -- helpers -------------------------------------------------------------------------------------------------
def make_operands(m, n, k, dtype, adversarial=False, group_size=64, seed=0, s_dtype=None):
    """x [m, k] in dtype; w quantized from normal * 0.02 weights (adversarial: plus a per-row offset up to +-4,
    i.e. biases hundreds of times the scales, and x all positive, so nothing cancels; x is scaled by 16 / sqrt(k)
    so that the outputs, ~K * mean(x) * 4, stay inside float16's range)."""
    rng = np.random.default_rng(seed)
    wf = rng.standard_normal((n, k)).astype(np.float32) * 0.02
    x = rng.standard_normal((m, k)).astype(np.float32)
    if adversarial:
        wf += rng.uniform(-4, 4, (n, 1)).astype(np.float32)
        x = (np.abs(x) + 0.5) * np.float32(16 / k**0.5)
    w, scales, biases = mx.quantize(mx.array(wf).astype(s_dtype or dtype), group_size=group_size, bits=4)
    x = mx.array(x).astype(dtype)
    mx.eval(x, w, scales, biases)
    return x, w, scales, biases


def reference(x, w, scales, biases, group_size=64, weights_in=None):
    """(x @ W.T, |x| @ |W|.T) as float64 numpy arrays, W = mx.dequantize(w) from float32 scales and biases
    (on the CPU stream; exact but for one rounding of q * s + b), then rounded to `weights_in` where given (a kernel
    that makes each weight whole in a 16-bit type). float64, not MLX: a float32 matmul is itself off by ~1e-5 of
    |x| @ |W|.T at K = 14336 (and runs as TF32 on CUDA)."""
    with mx.stream(mx.cpu):
        deq = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group_size, bits=4)
        if weights_in is not None:
            deq = deq.astype(weights_in).astype(mx.float32)
        x32 = x.astype(mx.float32)
        mx.eval(deq, x32)
    deq = np.array(deq).astype(np.float64)
    x64 = np.array(x32).astype(np.float64).reshape(-1, deq.shape[1])
    return x64 @ deq.T, np.abs(x64) @ np.abs(deq).T


def check_close(y, ref, mag, dtype, what=""):
    assert y.shape == ref.shape, f"{what}: shape {y.shape} != {ref.shape}"
    y32 = np.array(y.astype(mx.float32)).astype(np.float64)
    assert np.isfinite(y32).all(), f"{what}: non-finite output"
    bound = RTOL[dtype] * np.abs(ref) + ATOL_MAG[dtype] * mag
    excess = np.abs(y32 - ref) - bound
    worst = np.unravel_index(np.argmax(excess), excess.shape)
    assert excess.max() <= 0, (
        f"{what}: |y - ref| = {abs(y32 - ref)[worst]:.4g} > {bound[worst]:.4g} at {worst} "
        f"(y {y32[worst]:.6g}, ref {ref[worst]:.6g})"
    )


def emulate_kernel(x, w, scales, biases, group_size, exact=False):
    """The kernel's arithmetic in numpy float32 (FMAs unfused): fp16 magic-number pairs, offsets removed per
    32-element chunk, s * (sum x (O + q) - sum x O) + b * sum x per chunk; `exact` (a float32 output): offsets
    removed from each weight instead. x [M, K], w [N, K/8] -> [M, N]."""
    x = np.array(x.astype(mx.float32))
    w = np.array(w)
    s, b = np.array(scales.astype(mx.float32)), np.array(biases.astype(mx.float32))
    m, k = x.shape
    n = w.shape[0]

    def pair(v, mask, magic):
        return ((v & mask) | magic).astype(np.uint32).view(np.float16).astype(np.float32).reshape(*v.shape, 2)

    w8 = w >> 8
    v04, v15 = pair(w, 0x000F000F, 0x64006400), pair(w, 0x00F000F0, 0x54005400)
    v26, v37 = pair(w8, 0x000F000F, 0x64006400), pair(w8, 0x00F000F0, 0x54005400)
    offset_q = np.stack(
        [v04[..., 0], v15[..., 0], v26[..., 0], v37[..., 0], v04[..., 1], v15[..., 1], v26[..., 1], v37[..., 1]], -1
    ).reshape(n, k)
    if exact:
        offset_q = offset_q - np.tile(np.float32([1024, 64, 1024, 64]), 2 * k // 8)
    chunks = k // 32
    xc, vc = x.reshape(m, chunks, 32), offset_q.reshape(n, chunks, 32)
    part = np.zeros((n, m, chunks), np.float32)
    xs = np.zeros((m, chunks), np.float32)
    xo = np.zeros((m, chunks), np.float32)
    for i in range(4):
        xw = xc[:, :, 8 * i : 8 * i + 8]
        se = (xw[..., 0] + xw[..., 2]) + (xw[..., 4] + xw[..., 6])
        so = (xw[..., 1] + xw[..., 3]) + (xw[..., 5] + xw[..., 7])
        xs = xs + (se + so)
        if not exact:
            xo = np.float32(1024) * se + (np.float32(64) * so + xo)
        for e in range(8):
            part = part + xw[None, :, :, e] * vc[:, None, :, 8 * i + e]
    group = (np.arange(chunks) * 32) // group_size
    sc, bc = s[:, group][:, None, :], b[:, group][:, None, :]
    return (sc * (part - xo[None]) + bc * xs[None]).sum(-1, dtype=np.float32).T


def greedy(model, prompt, steps):
    from mlxcel_core.cache import make_cache

    cache = make_cache(len(model.layers))
    logits = model(mx.array([prompt]), cache)[:, -1]
    tokens = []
    for _ in range(steps):
        token = mx.argmax(logits, axis=-1)
        tokens.append(token.item())
        logits = model(token[:, None], cache)[:, -1]
    return tokens


def forced_logits(model, prompt, tokens):
    """Logits [len(tokens), vocab] (float32) of each decode step, feeding `tokens` one at a time."""
    from mlxcel_core.cache import make_cache

    cache = make_cache(len(model.layers))
    out = [model(mx.array([prompt]), cache)[0, -1]]
    for t in tokens[:-1]:
        out.append(model(mx.array([[t]]), cache)[0, -1])
    return np.array(mx.stack(out).astype(mx.float32))


# -- everywhere ----------------------------------------------------------------------------------------------
def test_mlx_packing_is_nibble_j_in_bits_4j():
    x, w, scales, biases = make_operands(1, 8, 128, mx.float32)
    wn = np.array(w)
    q = np.stack([(wn >> (4 * j)) & 0xF for j in range(8)], -1).reshape(8, 128)
    s, b = np.repeat(np.array(scales), 64, 1), np.repeat(np.array(biases), 64, 1)
    deq = np.array(mx.dequantize(w, scales, biases, group_size=64, bits=4))
    np.testing.assert_allclose(q * s + b, deq, rtol=1e-6, atol=1e-7)


def test_magic_number_pairs():
    word = np.array([0x76543210, 0xFEDCBA98], dtype=np.uint32)
    lo = lambda v, mask, magic: ((v & mask) | magic).view(np.float16).astype(np.float32)  # noqa: E731
    np.testing.assert_array_equal(lo(word, 0x000F000F, 0x64006400), [1024, 1028, 1032, 1036])  # (q0, q4) + 1024
    np.testing.assert_array_equal(lo(word, 0x00F000F0, 0x54005400), [65, 69, 73, 77])  # (q1, q5) + 64
    np.testing.assert_array_equal(lo(word >> 8, 0x000F000F, 0x64006400), [1026, 1030, 1034, 1038])
    np.testing.assert_array_equal(lo(word >> 8, 0x00F000F0, 0x54005400), [67, 71, 75, 79])


@pytest.mark.parametrize(
    "m,n,k,group_size", [(1, 64, 4096, 64), (8, 32, 14336, 64), (3, 50, 576, 32), (2, 40, 4096, 128), (4, 16, 512, 64)]
)
@pytest.mark.parametrize("adversarial", [False, True], ids=["random", "adversarial"])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "fp16"])
def test_emulated_kernel_arithmetic_matches_dequantize(m, n, k, group_size, adversarial, dtype):
    x, w, scales, biases = make_operands(m, n, k, dtype, adversarial, group_size, seed=m + k)
    ref, mag = reference(x, w, scales, biases, group_size)
    emu = emulate_kernel(x, w, scales, biases, group_size)
    err = np.abs(emu - ref) / mag
    assert err.max() <= ATOL_MAG[dtype] / 2, f"float32 accumulation error {err.max():.3g} of |x| @ |W|.T"


@pytest.mark.parametrize("m,n,k,group_size", [(1, 64, 4096, 64), (8, 32, 14336, 64), (3, 50, 576, 32)])
@pytest.mark.parametrize("adversarial", [False, True], ids=["random", "adversarial"])
def test_emulated_float32_arithmetic_is_float32_accurate(m, n, k, group_size, adversarial):
    """A float32 output removes the offsets per weight: ~100x closer than the per-chunk removal."""
    x, w, scales, biases = make_operands(m, n, k, mx.float32, adversarial, group_size, seed=m + k)
    ref, mag = reference(x, w, scales, biases, group_size)
    err = np.abs(emulate_kernel(x, w, scales, biases, group_size, exact=True) - ref) / mag
    assert err.max() <= ATOL_MAG[mx.float32] / 2, f"float32 accumulation error {err.max():.3g} of |x| @ |W|.T"
    if not adversarial:  # the bound tells the two apart: the per-chunk removal does not meet it
        chunked = np.abs(emulate_kernel(x, w, scales, biases, group_size) - ref) / mag
        assert chunked.max() > ATOL_MAG[mx.float32] / 2


def test_shape_supported():
    u32, bf, f16, f32 = mx.uint32, mx.bfloat16, mx.float16, mx.float32

    def ok(x_shape, n=4096, k=4096, gs=64, bits=4, x_dtype=bf, s_dtype=bf, b_dtype=None, biases=True):
        g = (n, k // gs)
        return shape_supported(
            x_shape, x_dtype, (n, k * bits // 32), u32, g, s_dtype, g if biases else None, b_dtype or s_dtype, gs, bits
        )

    assert ok((1, 4096)) and ok((1, 1, 4096)) and ok((8, 4096)) and ok((2, 4, 4096)) and ok((4096,))
    assert ok((1, 4096), x_dtype=f16, s_dtype=f16) and ok((1, 4096), x_dtype=f32, s_dtype=bf)
    assert ok((1, 576), n=49152, k=576) and ok((3, 1536), n=576, k=1536, gs=32) and ok((1, 4096), gs=128)
    assert not ok((9, 4096)) and not ok((1, 9, 4096)) and not ok((0, 4096))  # prefill / empty
    assert not ok((1, 4096), bits=8) and not ok((1, 4096), gs=16) and not ok((1, 4096), biases=False)
    assert not ok((1, 4096), x_dtype=mx.int32) and not ok((1, 4096), s_dtype=bf, b_dtype=f16)
    assert not ok((1, 4095)) and not ok((1, 4096 + 32))  # x does not match w
    assert ok((1, 64), n=8, k=64) and ok((2, 96), n=8, k=96, gs=32)  # K: any multiple of the group size


@pytest.mark.skipif(cuda_kernel_available(), reason="checks the fallback (no CUDA kernel here)")
@pytest.mark.parametrize("x_shape", [(1, 512), (1, 1, 512), (8, 512), (3, 5, 512), (512,)])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32], ids=["bf16", "fp16", "fp32"])
def test_fallback_is_quantized_matmul_exactly(x_shape, dtype):
    _, w, scales, biases = make_operands(1, 96, 512, dtype)
    x = mx.random.normal(x_shape, key=mx.random.key(3)).astype(dtype)
    assert not supports(x, w, scales, biases)
    got = quantized_matvec(x, w, scales, biases, group_size=64, bits=4)
    want = mx.quantized_matmul(x, w, scales=scales, biases=biases, transpose=True, group_size=64, bits=4)
    assert got.dtype == want.dtype and got.shape == want.shape and mx.array_equal(got, want).item()


def test_fallback_for_other_bits_and_groups():
    w, scales, biases = mx.quantize(mx.random.normal((64, 256), key=mx.random.key(0)), group_size=32, bits=8)
    x = mx.random.normal((1, 256), key=mx.random.key(1))
    assert not supports(x, w, scales, biases, group_size=32, bits=8)
    got = quantized_matvec(x, w, scales, biases, group_size=32, bits=8)
    want = mx.quantized_matmul(x, w, scales=scales, biases=biases, transpose=True, group_size=32, bits=8)
    assert mx.array_equal(got, want).item()


def test_launch_args():
    args = qmv.launch_args((1, 1, 4096), mx.bfloat16, mx.bfloat16, 14336, 64)
    cfg = dict(args["template"])["CFG"]
    rows, warps, unroll = launch_config(14336, 4096, 1)
    assert (cfg & 15, cfg >> 4 & 255, cfg >> 12 & 15, cfg >> 16 & 15, cfg >> 20 & 15) == (1, 64, rows, warps, unroll)
    assert args["output_shapes"] == [(1, 1, 14336)] and args["output_dtypes"] == [mx.bfloat16]
    assert args["grid"] == (-(-14336 // rows) * warps * 32, 1, 1) and args["threadgroup"] == (warps * 32, 1, 1)
    assert qmv.launch_args((2, 4096), mx.bfloat16, mx.float16, 64, 32)["output_dtypes"] == [mx.float32]
    assert qmv.launch_args((9, 4096), mx.bfloat16, mx.bfloat16, 64, 64) is None
    assert qmv.launch_args((3, 4096), mx.bfloat16, mx.bfloat16, 64, 64, max_rows=2) is None
    assert qmv.launch_args((1, 4096), mx.int32, mx.bfloat16, 64, 64) is None
    assert qmv.launch_args((0, 4096), mx.bfloat16, mx.bfloat16, 64, 64) is None


def test_rope_launch_writes_heads_first_at_one_token():
    """The qkv_rope modes' outputs for x [B, 1, K] are [B, heads, 1, head_dim] (the attention's layout, the same
    memory as [B, 1, heads * head_dim]); other shapes of x keep [..., width]."""
    split = (2048, 512, 64)
    for mode, eps in (("qkv_rope", None), ("qkv_norm_rope", 1e-6)):
        args = qmv.launch_args((2, 1, 2048), mx.bfloat16, mx.bfloat16, 3072, 64, mode=mode, split=split, eps=eps)
        assert args["output_shapes"] == [(2, 32, 1, 64), (2, 8, 1, 64), (2, 8, 1, 64)]
        args = qmv.launch_args((1, 3, 2048), mx.bfloat16, mx.bfloat16, 3072, 64, mode=mode, split=split, eps=eps)
        assert args["output_shapes"] == [(1, 3, 2048), (1, 3, 512), (1, 3, 512)]
        args = qmv.launch_args((4, 2048), mx.bfloat16, mx.bfloat16, 3072, 64, mode=mode, split=split, eps=eps)
        assert args["output_shapes"] == [(4, 2048), (4, 512), (4, 512)]
    args = qmv.launch_args((2, 1, 2048), mx.bfloat16, mx.bfloat16, 3072, 64, mode="qkv", split=split[:2])
    assert args["output_shapes"] == [(2, 1, 2048), (2, 1, 512), (2, 1, 512)]


def test_launch_config():
    for n, k in DECODE_SHAPES + [(128256, 4096), (576, 1536), (49152, 576)]:
        for m in range(1, qmv.MAX_ROWS + 1):
            rows, warps, unroll = launch_config(n, k, m)
            assert rows in (1, 2, 4, 8) and warps in (1, 2, 4, 8) and unroll in (1, 2)
            assert warps == 1 or warps * 32 * qmv.CHUNK <= k  # every warp has a whole round of K
    assert launch_config(128256, 4096, 1)[1] == 1  # the LM head has blocks enough without splitting K


# -- CUDA: the kernel ------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=2)
def _decode_case(n, k, dtype, adversarial):
    x, w, scales, biases = make_operands(8, n, k, dtype, adversarial, seed=n + k)
    ref, mag = reference(x, w, scales, biases)
    return x, w, scales, biases, ref, mag


@needs_cuda
@pytest.mark.parametrize("adversarial", [False, True], ids=["random", "adversarial"])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("n,k", DECODE_SHAPES, ids=[f"{n}x{k}" for n, k in DECODE_SHAPES])
def test_kernel_matches_dequantize_reference(n, k, dtype, adversarial):
    x, w, scales, biases, ref, mag = _decode_case(n, k, dtype, adversarial)
    for m in (1, 2, 4, 8):
        assert supports(x[:m], w, scales, biases)
        y = quantized_matvec(x[:m], w, scales, biases)
        assert y.dtype == dtype
        check_close(y, ref[:m], mag[:m], dtype, f"M={m} N={n} K={k}")


@needs_cuda
@pytest.mark.parametrize("m", [1, 5])
def test_every_launch_config(m):
    """Every (ROWS, WARPS) with UNROLL 1 (benchmarks/qmv.py's sweep) and a few with UNROLL 2."""
    n, k = 1003, 4608  # N not a multiple of any ROWS; K 4.5 rounds of 1024, so lanes have unequal chunk counts
    x, w, scales, biases = make_operands(m, n, k, mx.bfloat16, seed=11)
    ref, mag = reference(x, w, scales, biases)
    configs = [(rows, warps, 1) for rows in (1, 2, 4, 8) for warps in (1, 2, 4, 8)] + [(4, 2, 2), (8, 1, 2)]
    configs += [(2, 1, 1, 8), (4, 1, 2, 4), (2, 2, 1, 4), (8, 4, 1, 2)]  # several groups to a CUDA block
    for config in configs:
        y = cuda_quantized_matvec(x, w, scales, biases, 64, config=config)
        check_close(y, ref, mag, mx.bfloat16, f"M={m} config={config}")


@needs_cuda
@pytest.mark.parametrize(
    "m,n,k,group_size",
    [
        (1, 49152, 576, 64),
        (3, 576, 1536, 64),
        (2, 300, 2048, 32),
        (5, 257, 4096, 128),
        (7, 64, 32 * 3, 32),
        (1, 1, 4096, 64),
    ],
)
@pytest.mark.parametrize("adversarial", [False, True], ids=["random", "adversarial"])
def test_other_shapes_and_group_sizes(m, n, k, group_size, adversarial):
    for dtype in (mx.bfloat16, mx.float16):
        x, w, scales, biases = make_operands(m, n, k, dtype, adversarial, group_size, seed=n)
        ref, mag = reference(x, w, scales, biases, group_size)
        assert supports(x, w, scales, biases, group_size)
        check_close(quantized_matvec(x, w, scales, biases, group_size), ref, mag, dtype, f"{dtype} {m}x{n}x{k}")


@needs_cuda
def test_float32_and_mixed_dtypes():
    for x_dtype, s_dtype in [
        (mx.float32, mx.float32),
        (mx.float32, mx.bfloat16),
        (mx.bfloat16, mx.float16),
        (mx.float16, mx.float32),
    ]:
        x, w, scales, biases = make_operands(4, 512, 4096, x_dtype, s_dtype=s_dtype, seed=5)
        ref, mag = reference(x, w, scales, biases)
        y = quantized_matvec(x, w, scales, biases)
        want_dtype = mx.result_type(x, scales)
        assert y.dtype == want_dtype == mx.quantized_matmul(x, w, scales, biases, transpose=True).dtype
        check_close(y, ref, mag, want_dtype, f"x {x_dtype} scales {s_dtype}")


@needs_cuda
def test_batched_misaligned_and_strided_inputs():
    x, w, scales, biases = make_operands(8, 1024, 4096, mx.bfloat16, seed=9)
    ref, mag = reference(x, w, scales, biases)
    y = quantized_matvec(x.reshape(4, 2, 4096), w, scales, biases)
    assert y.shape == (4, 2, 1024)
    check_close(y.reshape(8, 1024), ref, mag, mx.bfloat16, "3-D input")
    check_close(quantized_matvec(x[0], w, scales, biases)[None], ref[:1], mag[:1], mx.bfloat16, "1-D input")
    flat = mx.concatenate([mx.zeros((1,), mx.bfloat16), x.reshape(-1)])
    shifted = flat[1:].reshape(8, 4096)  # 2 bytes past a 16-byte boundary: the kernel's scalar loads
    check_close(quantized_matvec(shifted, w, scales, biases), ref, mag, mx.bfloat16, "misaligned x")
    strided = mx.stack([x, x], axis=-1)[..., 0]  # not row-contiguous: MLX copies it for the kernel
    check_close(quantized_matvec(strided, w, scales, biases), ref, mag, mx.bfloat16, "strided x")
    w_rows = mx.concatenate([w, w])[1024:]  # a row slice: a view at an offset of whole rows
    check_close(quantized_matvec(x, w_rows, scales, biases), ref, mag, mx.bfloat16, "sliced w")
    w_flat = mx.concatenate([mx.zeros((1,), mx.uint32), w.reshape(-1)])
    w_shifted = w_flat[1:].reshape(w.shape)  # 4 bytes past a 16-byte boundary: the kernel's 4-byte weight loads
    check_close(quantized_matvec(x, w_shifted, scales, biases), ref, mag, mx.bfloat16, "misaligned w")


@needs_cuda
def test_more_rows_fall_back_and_results_are_deterministic():
    x, w, scales, biases = make_operands(9, 512, 4096, mx.bfloat16, seed=2)
    assert not supports(x, w, scales, biases)
    want = mx.quantized_matmul(x, w, scales=scales, biases=biases, transpose=True, group_size=64, bits=4)
    assert mx.array_equal(quantized_matvec(x, w, scales, biases), want).item()
    for m in (1, 8):
        a = quantized_matvec(x[:m], w, scales, biases)
        assert mx.array_equal(a, quantized_matvec(x[:m], w, scales, biases)).item()
