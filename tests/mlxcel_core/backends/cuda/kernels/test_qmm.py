"""The tensor-core 4-bit kernel for decode batches (mlxcel_core/backends/cuda/kernels/qmm.py).

Everywhere: the kernel's index mapping emulated in numpy, thread by thread, with the PTX fragment layouts of
mma.m16n8k16 (A: a0a1 at (g, 2t..2t+1), a2a3 at (g+8, 2t..), a4a5 at (g, 2t+8..), a6a7 at (g+8, 2t+8..); B: b0b1 at
(2t..2t+1, g), b2b3 at (2t+8.., g); C: c0c1 at (g, 2t..2t+1), c2c3 at (g+8, 2t..)), against x @ W.T in float64,
W = dequantize(w) rounded to x's type as the kernel makes its weights; the split of K, the launch arguments, the
source compiled for sm_90 without spills (where nvcc is).
CUDA only: the kernel against the same reference (test_qmv.py's tolerance), 1..32 rows, both 16-bit types.
"""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest
from cuda_compile import CUDA_TYPES, compile_sm90, kernel_file, needs_nvcc
from test_qmv import check_close, make_operands, needs_cuda, reference

from mlxcel_core.backends.cuda.kernels import qmm


def _pair4(v: int) -> tuple[int, int]:
    """mlxcel_qmm_pair4: the nibbles in bits 0-3 and 16-19 of v."""
    return v & 0xF, (v >> 16) & 0xF


def _paired(vals: np.ndarray) -> np.ndarray:
    """8 consecutive x values in the order the block pass leaves them in shared memory: x0 x4 x1 x5 x2 x6 x3 x7."""
    return vals[[0, 4, 1, 5, 2, 6, 3, 7]]


def dequantized(scales: np.ndarray, biases: np.ndarray, dtype) -> np.ndarray:
    """Every weight a nibble q makes, q s + b rounded to dtype (mlxcel_qmm_dequant2), as [N, groups, 16]; rounded
    through float32 as test_qmv.reference(weights_in=) rounds it (q s + b is exact in float32 for these operands)."""
    exact = np.arange(16.0)[None, None, :] * scales[:, :, None] + biases[:, :, None]
    return np.array(mx.array(exact.astype(np.float32)).astype(dtype).astype(mx.float32)).astype(np.float64)


def emulate(x: np.ndarray, w: np.ndarray, scales: np.ndarray, biases: np.ndarray, group_size: int, dtype) -> np.ndarray:
    """The kernel's arithmetic for x [M, K] (the 16-bit values, as float64) and packed w [N, K / 8], following its
    source index by index, one warp tile (16 weight rows) at a time and one split (the whole K): nibbles 4 apart
    made weights in dtype, paired against x in the block pass's order."""
    m_rows, k_len = x.shape
    n_rows = w.shape[0]
    ng, nt_count = k_len // group_size, -(-m_rows // 8)
    table = dequantized(scales, biases, dtype)
    out = np.zeros((m_rows, n_rows))
    for n0 in range(0, n_rows, 16):
        tot = np.zeros((32, nt_count, 4))
        for gi in range(ng):
            for s in range(group_size // 16):
                a_tile = np.full((16, 16), np.nan)
                b_tiles = np.full((nt_count, 16, 8), np.nan)
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    r0, r1 = min(n0 + g, n_rows - 1), min(n0 + g + 8, n_rows - 1)
                    # this thread's G / 32 words of the group, loaded at once; step s: word s / 2
                    words = group_size // 32
                    word = gi * (group_size // 8) + t * words + (s >> 1)
                    assert (s >> 1) < words
                    k = gi * group_size + t * (group_size // 4) + 4 * s
                    # nibbles j, j + 4 and j + 1, j + 5 of the whole word, j = 2 (s & 1)
                    v0, v1 = int(w[r0, word]) >> (8 * (s & 1)), int(w[r1, word]) >> (8 * (s & 1))
                    regs = [(r0, _pair4(v0)), (r1, _pair4(v1)), (r0, _pair4(v0 >> 4)), (r1, _pair4(v1 >> 4))]
                    # PTX A layout: register i holds elements (row, col) as in the docstring
                    places = [(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]
                    for (r, reg), (row, col) in zip(regs, places):
                        a_tile[row, col], a_tile[row, col + 1] = table[r, gi, reg[0]], table[r, gi, reg[1]]
                    for nt in range(nt_count):
                        m = nt * 8 + g
                        # the word's 8 values in shared memory, paired; step s reads 4 of them
                        base = k - 4 * (s & 1)
                        vals = _paired(x[m, base : base + 8])[4 * (s & 1) :][:4] if m < m_rows else np.zeros(4)
                        b_tiles[nt, 2 * t, g], b_tiles[nt, 2 * t + 1, g] = vals[0], vals[1]
                        b_tiles[nt, 2 * t + 8, g], b_tiles[nt, 2 * t + 9, g] = vals[2], vals[3]
                assert not np.isnan(a_tile).any() and not np.isnan(b_tiles).any()  # every element placed once
                for nt in range(nt_count):
                    c = a_tile @ b_tiles[nt]
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        tot[lane, nt] += [c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1]]
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            for nt in range(nt_count):
                for i in range(4):
                    m, n = nt * 8 + 2 * t + (i & 1), n0 + g + (i >> 1) * 8
                    if m < m_rows and n < n_rows:
                        out[m, n] = tot[lane, nt, i]
    return out


@pytest.mark.parametrize(
    "m,n,k,group_size",
    [(8, 32, 128, 64), (19, 40, 128, 32), (3, 16, 256, 128), (32, 24, 64, 64), (64, 16, 128, 64), (41, 16, 64, 32)],
)
def test_emulated_kernel_matches_the_reference(m, n, k, group_size):
    x, w, scales, biases = make_operands(m, n, k, mx.bfloat16, group_size=group_size, seed=m + n)
    ref, mag = reference(x, w, scales, biases, group_size, weights_in=mx.bfloat16)
    got = emulate(
        np.array(x.astype(mx.float32)).astype(np.float64),
        np.array(w),
        np.array(scales.astype(mx.float32)).astype(np.float64),
        np.array(biases.astype(mx.float32)).astype(np.float64),
        group_size,
        mx.bfloat16,
    )
    assert np.abs(got - ref).max() <= 1e-9 * max(1.0, mag.max())  # the same sums, in float64


def test_split_k():
    assert qmm.split_k(14336, 64) == (2, 32)  # 112 blocks of 128 rows: two parts of K
    assert qmm.split_k(4096, 224) == (5, 45)  # 32 blocks: 5 parts (the last 44 groups)
    assert qmm.split_k(128256, 64) == (1, 64)  # the LM head fills the GPU alone
    assert qmm.split_k(16, 1) == (1, 1)
    for n, groups in [(1024, 64), (4096, 64), (6144, 32), (300, 7)]:
        splits, gps = qmm.split_k(n, groups)
        assert (splits - 1) * gps < groups <= splits * gps


def test_launch_args():
    args = qmm.launch_args((19, 1, 4096), mx.bfloat16, mx.bfloat16, 14336, 4096, 64)
    assert dict(args["template"]) == {"T": mx.bfloat16, "S": mx.bfloat16, "G": 64, "NT": 3, "GPS": 32}
    assert dict(qmm.launch_args((24, 4096), mx.bfloat16, mx.bfloat16, 14336, 4096, 64)["template"])["NT"] == 3
    assert args["grid"] == (112 * 256, 2, 1) and args["threadgroup"] == (256, 1, 1)  # 112 blocks of 128 rows
    assert args["output_shapes"] == [(2, 19, 14336)] and args["output_dtypes"] == [mx.float32]
    assert qmm.launch_args((qmm.MAX_ROWS + 1, 4096), mx.bfloat16, mx.bfloat16, 64, 4096, 64) is None  # too many rows
    assert qmm.launch_args((9, 4096), mx.float32, mx.float32, 64, 4096, 64) is None  # 16-bit x only
    assert qmm.launch_args((9, 4096), mx.bfloat16, mx.bfloat16, 64, 4096, 48) is None  # group size
    assert qmm.launch_args((9, 4000), mx.bfloat16, mx.bfloat16, 64, 4096, 64) is None  # x is not K wide


@needs_nvcc
@pytest.mark.parametrize(
    "x_dtype,s_dtype,m,group_size",
    [
        (mx.bfloat16, mx.bfloat16, 32, 64),
        (mx.float16, mx.float16, 9, 128),
        (mx.bfloat16, mx.float32, 17, 32),
        (mx.bfloat16, mx.bfloat16, 64, 64),
        (mx.float16, mx.float16, 48, 32),
    ],
)
def test_kernel_compiles_for_sm90_without_spills(tmp_path, x_dtype, s_dtype, m, group_size):
    args = qmm.launch_args((m, 4096), x_dtype, s_dtype, 4096, 4096, group_size)
    header, source = qmm.kernel_source()
    params = [
        f"    const {CUDA_TYPES[x_dtype]}* x",
        "    const __grid_constant__ Shape x_shape",
        "    const __grid_constant__ int x_ndim",
        "    const uint32_t* w",
        "    const __grid_constant__ Shape w_shape",
        f"    const {CUDA_TYPES[s_dtype]}* scales",
        f"    const {CUDA_TYPES[s_dtype]}* biases",
        "    float* partial",
    ]
    text = kernel_file(qmm.KERNEL_NAME, params, dict(args["template"]), source, header)
    report = compile_sm90(tmp_path, text)
    # two chunk buffers of 8 NT rows in static shared memory (a block may hold at most 48 KiB of it)
    smem = int(re.search(r"(\d+) bytes smem", report).group(1))
    rows = -(-m // 8) * 8
    chunk = qmm.CHUNK_K // 2 if rows > 32 else qmm.CHUNK_K  # (half a chunk past 4 tiles)
    assert smem == 2 * rows * (chunk + 4) * 2 <= 48 << 10, report


@needs_nvcc
@pytest.mark.parametrize("m", [9, 32, 64])
def test_the_kernel_fits_two_blocks_an_sm_without_spills(tmp_path, monkeypatch, m):
    """The kernel's translation unit as the kernel cache builds it (__launch_bounds__(256, 2)): at most
    128 registers a thread, none spilled, so two blocks of 256 threads fit an SM's 65536 (groups of 64, up to 64
    rows)."""
    from types import SimpleNamespace

    from mlxcel_core.backends.cuda.kernels.cubin_cache import kernel_text

    monkeypatch.setattr(qmm, "cuda_kernel", lambda **kwargs: SimpleNamespace(**kwargs))
    qmm._kernel.cache_clear()
    try:
        kernel = qmm._kernel()
    finally:
        qmm._kernel.cache_clear()
    assert kernel.launch_bounds == (qmm.WARPS * 32, qmm.MIN_BLOCKS) == (256, 2)
    args = qmm.launch_args((m, 4096), mx.bfloat16, mx.bfloat16, 14336, 4096, 64)
    header, source = qmm.kernel_source()
    dtypes = [mx.bfloat16, mx.uint32, mx.bfloat16, mx.bfloat16]
    text = kernel_text(
        "k",
        source,
        header,
        kernel.input_names,
        dtypes,
        [2, 2, 2, 2],
        ["partial"],
        [mx.float32],
        args["template"],
        launch_bounds=kernel.launch_bounds,
    )
    assert "__launch_bounds__(256, 2) k(" in text
    report = compile_sm90(tmp_path, text)
    assert int(re.search(r"Used (\d+) registers", report).group(1)) <= 128, report


@needs_cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("n,k,group_size", [(4096, 4096, 64), (1024, 14336, 64), (1000, 512, 32), (333, 1024, 128)])
def test_kernel_matches_the_reference(dtype, n, k, group_size):
    x, w, scales, biases = make_operands(32, n, k, dtype, group_size=group_size, seed=n)
    ref, mag = reference(x, w, scales, biases, group_size, weights_in=dtype)
    for m in (1, 8, 9, 19, 32):
        y = qmm.quantized_matmul(x[:m], w, scales, biases, group_size)
        assert y.dtype == dtype and y.shape == (m, n)
        check_close(y, ref[:m], mag[:m], dtype, f"M={m} N={n} K={k}")
    y = qmm.quantized_matmul(x[:12].reshape(12, 1, k), w, scales, biases, group_size)
    assert y.shape == (12, 1, n)
    check_close(y.reshape(12, n), ref[:12], mag[:12], dtype, "[12, 1, K]")


@needs_cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("s_dtype", [None, mx.float32], ids=["scales-in-x-type", "float32-scales"])
def test_large_biases_and_float32_scales(dtype, s_dtype):
    """Biases hundreds of times the scales and x all positive (nothing cancels), with scales and biases in x's type
    (one 16-bit fused multiply-add a weight pair) and in float32 (float32 ones, then one rounding to x's type)."""
    x, w, scales, biases = make_operands(40, 1000, 1024, dtype, adversarial=True, seed=7, s_dtype=s_dtype)
    ref, mag = reference(x, w, scales, biases, weights_in=dtype)
    for m in (9, 40):
        check_close(qmm.quantized_matmul(x[:m], w, scales, biases, 64), ref[:m], mag[:m], dtype, f"M={m}")


@needs_cuda
def test_kernel_on_misaligned_views():
    """x and w starting past an aligned address (views into larger arrays): the kernel's narrower loads there."""
    x, w, scales, biases = make_operands(12, 512, 1024, mx.bfloat16, seed=4)
    ref, mag = reference(x, w, scales, biases, weights_in=mx.bfloat16)
    flat = mx.concatenate([mx.zeros((1,), mx.bfloat16), x.reshape(-1)])
    check_close(
        qmm.quantized_matmul(flat[1:].reshape(12, 1024), w, scales, biases, 64), ref, mag, mx.bfloat16, "misaligned x"
    )
    for pad in (1, 2):  # 4 and 8 bytes past a 16-byte boundary
        w_flat = mx.concatenate([mx.zeros((pad,), mx.uint32), w.reshape(-1)])
        check_close(
            qmm.quantized_matmul(x, w_flat[pad:].reshape(w.shape), scales, biases, 64),
            ref,
            mag,
            mx.bfloat16,
            f"w {4 * pad} bytes off",
        )


@pytest.mark.parametrize("gps", [64, 16])  # (K = 4096 in groups of 64: one split, then four)
def test_the_partial_sums_become_the_product_without_a_gather(tmp_path, monkeypatch, gps):
    """After the launch, one split's partials [1, M, N] are the product through a reshape (MLX's `a[0]` is a Gather:
    a kernel a call, at a 32-row 8B step 33 launches of 18 us), several splits' a sum; then the cast. A stand-in
    kernel returns each split's index, so the values show which reduction ran."""

    def stand_in(**_):
        def launch(inputs, output_shapes, **__):
            splits, m, n = output_shapes[0]
            return [mx.broadcast_to(mx.arange(1, splits + 1, dtype=mx.float32)[:, None, None], (splits, m, n))]

        return launch

    monkeypatch.setattr(qmm, "_kernel", lambda *_: stand_in())
    x = mx.zeros((32, 1, 4096), mx.bfloat16)
    w, scales, biases = (
        mx.zeros((256, 512), mx.uint32),
        mx.zeros((256, 64), mx.bfloat16),
        mx.zeros((256, 64), mx.bfloat16),
    )
    y = qmm.quantized_matmul(x, w, scales, biases, 64, gps=gps)
    dot = tmp_path / "graph.dot"
    with open(dot, "w") as f:  # (before anything evaluates y: an evaluated array has no graph left)
        mx.export_to_dot(f, y)
    assert "Gather" not in dot.read_text()
    splits = 4096 // 64 // gps
    assert y.shape == (32, 1, 256) and y.dtype == mx.bfloat16
    assert mx.array_equal(y, mx.full(y.shape, splits * (splits + 1) // 2, mx.bfloat16)).item()


def test_kernel_name_carries_the_source_hash():
    """MLX caches compiled kernels on disk by name: an edited source, or another block width (which the source reads
    from blockDim, and tuned splits are keyed on), must get a new name."""
    import hashlib

    header, source = qmm.kernel_source()
    digest = hashlib.sha256((header + source + f"/{qmm.WARPS}").encode()).hexdigest()[:8]
    assert qmm.KERNEL_NAME == "mlxcel_qmm_mma_" + digest


@needs_cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "n,k,group_size,gps",
    [(4096, 4096, 64, None), (1000, 14336, 64, None), (333, 1024, 128, 3), (100, 512, 32, 5), (64, 4096, 64, 64)],
)
def test_kernel_across_tiles_splits_and_chunks(dtype, n, k, group_size, gps):
    """Row counts that leave a tile part empty, weights whose last block has warps past N, splits that end inside a
    chunk of x in shared memory (gps not a multiple of the chunk's groups) and a whole K in one split; and x as a view
    at an odd offset (copied without cp.async). Within the reference's tolerance."""
    x, w, scales, biases = make_operands(33, n, k, dtype, group_size=group_size, seed=n + k)
    ref, mag = reference(x, w, scales, biases, group_size, weights_in=dtype)
    odd = x.reshape(-1)[1 : 1 + 12 * k].reshape(12, k)
    odd_ref, odd_mag = reference(odd, w, scales, biases, group_size, weights_in=dtype)
    for xs, want, want_mag in [(x[:m], ref[:m], mag[:m]) for m in (1, 8, 9, 19, 32)] + [(odd, odd_ref, odd_mag)]:
        y = qmm.quantized_matmul(xs, w, scales, biases, group_size, gps)
        assert y.dtype == dtype and y.shape == (xs.shape[0], n)
        check_close(y, want, want_mag, dtype, f"M={xs.shape[0]} N={n} K={k} gps={gps}")


@needs_cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("n,k,group_size", [(4096, 4096, 64), (1000, 1024, 32), (333, 1024, 128)])
def test_wide_launches_match_the_reference(dtype, n, k, group_size):
    """33..64 rows in one launch (5..8 tiles, half a chunk of K staged, groups of 32
    compiled for three blocks an SM), within the reference's tolerance."""
    x, w, scales, biases = make_operands(64, n, k, dtype, group_size=group_size, seed=n + 64)
    ref, mag = reference(x, w, scales, biases, group_size, weights_in=dtype)
    for m in (33, 40, 57, 64):
        y = qmm.quantized_matmul(x[:m], w, scales, biases, group_size)
        assert y.dtype == dtype and y.shape == (m, n)
        check_close(y, ref[:m], mag[:m], dtype, f"M={m} N={n} K={k}")
