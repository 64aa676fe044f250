"""The 4-bit batch kernel writing its own output (kernels/qmm.py, the experiment MLXCEL_QMM_OWN_OUTPUT): the tails of
qmm_source.TAILS.

Everywhere: each tail's source compiled for sm_90 within two blocks an SM (where nvcc is); which launches take a tail;
no sum, cast or gather left after the launch; the last blocks' counters kept a weight, a part and a thread. CUDA only:
the q/k/v tail against the same launch's product rotated, the swiglu and residual tails against the product then the
op. (The kernel itself with the switch on and off: test_qmm.py's test_kernel_across_tiles_splits_and_chunks.)
"""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest
from cuda_compile import compile_sm90, needs_nvcc
from test_qmv import make_operands, needs_cuda

from mlxcel_core.backends.cuda.kernels import qmm, qmm_source


@needs_nvcc
@pytest.mark.parametrize(
    "tail,m,gps",
    [("direct", 32, 64), ("last_block", 32, 16), ("last_block", 64, 16), ("last_block_qkv_rope", 32, 16),
     ("last_block_qkv_rope", 64, 16), ("last_block_swiglu", 32, 16), ("last_block_swiglu", 64, 16),
     ("last_block_residual", 32, 16), ("last_block_residual", 64, 16)],
)  # fmt: skip
def test_the_kernel_writing_its_product_fits_two_blocks_an_sm(tmp_path, tail, m, gps):
    """MLXCEL_QMM_OWN_OUTPUT's kernels as the kernel cache builds them (the product in bf16: one split directly,
    several summed by the last block of a column; q, k, v rotated; silu(gate) * up; plus a residual): at most 128
    registers a thread, none spilled; the last block counts itself in with an atomic and reads the partials from L2;
    the swiglu tail's blocks take gate rows and the up rows below them."""
    from mlxcel_core.backends.cuda.kernels.cubin_cache import kernel_text

    header, source = qmm.kernel_source(tail)
    inputs = ["x", "w", "scales", "biases", *qmm._EXTRA_INPUTS.get(tail, [])]
    types = {"w": mx.uint32, "counters": mx.int32, "positions": mx.float32, "inv_freq": mx.float32}
    outputs = qmm._OUTPUTS[tail]
    template = qmm.launch_args((m, 4096), mx.bfloat16, mx.bfloat16, 6144, 4096, 64, gps)["template"]
    template += [("NQ", 4096), ("NK", 1024), ("HD", 128)] if tail.endswith("rope") else []
    text = kernel_text("k", source, header, inputs, [types.get(i, mx.bfloat16) for i in inputs], [2] * len(inputs),
                       outputs, [mx.float32 if o == "partial" else mx.bfloat16 for o in outputs], template,
                       launch_bounds=(qmm.WARPS * 32, qmm.MIN_BLOCKS))  # fmt: skip
    report = compile_sm90(tmp_path, text)
    assert int(re.search(r"Used (\d+) registers", report).group(1)) <= 128, report
    assert re.search(r"0 bytes spill stores, 0 bytes spill loads", report), report
    assert ("atomicAdd(counter, 1)" in source) == ("mlxcel_qmm_split_sums<" in source) == (tail != "direct")
    assert (qmm_source.SWIGLU_N0 in source) == (qmm_source.ROW_MAP not in source) == (tail == "last_block_swiglu")


def test_the_epilogue_tails_run_only_where_they_can(monkeypatch):
    """The q/k/v, swiglu and residual tails (MLXCEL_QMM_OWN_OUTPUT): only with the switch on; q/k/v in whole heads of
    32, 64 or 128 (a block's 128 rows hold whole heads); [gate; up] halves of whole half-blocks (64 rows)."""

    def args(tail, n, widths=(), rows=32):
        return qmm.tail_args(tail, (rows, 1, 4096), mx.bfloat16, mx.bfloat16, n, 4096, 64, widths)

    def clear():
        qmm.tail_args.cache_clear()
        qmm.launch_args.cache_clear()

    clear()
    assert args("last_block_qkv_rope", 6144, (4096, 1024, 128)) is None  # (the switch off)
    assert args("last_block_swiglu", 28672) is None and args("last_block_residual", 4096) is None
    monkeypatch.setenv("MLXCEL_QMM_OWN_OUTPUT", "1")
    clear()
    try:
        on = args("last_block_qkv_rope", 6144, (4096, 1024, 128))
        assert on["output_shapes"] == [(32, 4096), (32, 1024), (32, 1024), (on["grid"][1], 32, 6144)]
        assert dict(on["template"])["HD"] == 128 and on["output_dtypes"][3] == mx.float32
        assert args("last_block_qkv_rope", 5120, (3072, 1024, 64)) is not None
        assert args("last_block_qkv_rope", 3840, (2560, 640, 80)) is None  # (heads of 80 straddle blocks)
        assert args("last_block_qkv_rope", 6144 + 64, (4096 + 64, 1024, 128)) is None  # (not whole heads)
        assert args("last_block_qkv_rope", 6144, (4096, 1024, 128), rows=65) is None  # (past one launch)
        swiglu = args("last_block_swiglu", 28672)
        assert swiglu["output_shapes"][0] == (32, 14336) and args("last_block_swiglu", 28672 + 64) is None
        assert args("last_block_residual", 4096)["output_shapes"][0] == (32, 4096)
    finally:
        clear()


@pytest.mark.parametrize("gps", [64, 16])  # (K = 4096 in groups of 64: one split, then four)
def test_the_kernel_writing_its_product_leaves_nothing_after_the_launch(tmp_path, monkeypatch, gps):
    """With MLXCEL_QMM_OWN_OUTPUT=1 the launch's output is the product, in x's type: no sum and no cast after it
    (at a 32-row 8B step, 96 sums and 129 casts). Several splits take the weight's counters, one a block column. A
    stand-in kernel records what it was given."""
    seen = {}

    def stand_in(min_blocks, tail):
        def launch(inputs, output_shapes, output_dtypes, grid, **__):
            seen.update(tail=tail, inputs=len(inputs), dtypes=output_dtypes, grid=grid, counters=inputs[4:])
            return [mx.full(shape, 7.0, dtype) for shape, dtype in zip(output_shapes, output_dtypes)]

        return launch

    monkeypatch.setenv("MLXCEL_QMM_OWN_OUTPUT", "1")
    monkeypatch.setattr(qmm, "_kernel", stand_in)
    qmm.launch_args.cache_clear()
    try:
        x = mx.zeros((32, 1, 4096), mx.bfloat16)
        w = mx.zeros((256, 512), mx.uint32)
        scales = biases = mx.zeros((256, 64), mx.bfloat16)
        y = qmm.quantized_matmul(x, w, scales, biases, 64, gps=gps)
        dot = tmp_path / "graph.dot"
        with open(dot, "w") as f:
            mx.export_to_dot(f, y)
        graph = dot.read_text()
    finally:
        qmm.launch_args.cache_clear()
    assert "Sum" not in graph and "AsType" not in graph and "Gather" not in graph, graph
    assert y.shape == (32, 1, 256) and y.dtype == mx.bfloat16 and mx.all(y == 7).item()
    one = gps == 64
    assert seen["tail"] == ("direct" if one else "last_block") and seen["inputs"] == (4 if one else 5)
    assert seen["dtypes"] == ([mx.bfloat16] if one else [mx.bfloat16, mx.float32])
    if not one:
        (counters,) = seen["counters"]
        assert counters.dtype == mx.int32 and counters.size == seen["grid"][0] // (qmm.WARPS * 32)
        assert counters is qmm.counters(w, 0, counters.size)
        assert not mx.any(counters).item()


def test_counters_are_a_weights_a_parts_and_a_threads_and_go_with_the_weight():
    """Launches that may run side by side never share counters: each weight, each launch of a batch taken in parts,
    and each thread has its own; they are freed with the weight, and a thread's first launch may come inside a trace
    of mx.compile (a compiled decode step), which refuses evaluation."""
    import gc
    import threading

    w, other_w = mx.zeros((256, 32), mx.uint32), mx.zeros((256, 32), mx.uint32)
    first = qmm.counters(w, 0, 2)
    assert qmm.counters(w, 0, 2) is first and first.size == 2 and first.dtype == mx.int32
    assert qmm.counters(w, 1, 2) is not first and qmm.counters(other_w, 0, 2) is not first
    elsewhere = []
    thread = threading.Thread(target=lambda: elsewhere.append(qmm.counters(w, 0, 2) is first))
    thread.start()
    thread.join()
    assert elsewhere == [False]
    traced = []
    step = mx.compile(lambda x: x + qmm.counters(w, 2, 2))
    thread = threading.Thread(target=lambda: traced.append(step(mx.ones(2)).tolist()))
    thread.start()
    thread.join()
    assert traced == [[1, 1]]

    def launches_on_a_weight_that_goes():
        gone = mx.zeros((256, 32), mx.uint32)
        qmm.counters(gone, 0, 2), qmm.counters(gone, 1, 2)
        return len(qmm._counters)

    with_it = launches_on_a_weight_that_goes()
    gc.collect()
    assert len(qmm._counters) == with_it - 2


@needs_cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (16, 4, 64), (8, 2, 32)])
def test_the_qkv_tail_is_the_product_rotated(monkeypatch, dtype, heads, kv_heads, head_dim):
    """MLXCEL_QMM_OWN_OUTPUT's q/k/v tail against the same launch's product (the last block's sum of the same splits,
    rounded the same): v equal to it, q and k equal at position 0 and rotated within a rounding of the float64
    rotation elsewhere; the counters back at zero."""
    monkeypatch.setenv("MLXCEL_QMM_OWN_OUTPUT", "1")
    qmm.tail_args.cache_clear()
    qmm.launch_args.cache_clear()
    nq, nk, k = heads * head_dim, kv_heads * head_dim, 2048
    x, w, scales, biases = make_operands(64, nq + 2 * nk, k, dtype, seed=head_dim)
    inv_freq = mx.array(1.0 / 10000 ** (np.arange(0, head_dim, 2) / head_dim), mx.float32)
    half = head_dim // 2
    try:
        for m in (9, 19, 33, 64):
            xs = x[:m].reshape(m, 1, k)
            y = np.array(qmm.quantized_matmul(xs, w, scales, biases, 64).astype(mx.float32)).reshape(m, -1)
            for positions in (mx.zeros((m,), mx.float32), mx.arange(m).astype(mx.float32) * 37 + 5):
                q, kk, v = qmm.qkv_rope(xs, w, scales, biases, 64, (nq, nk, head_dim), (positions, inv_freq))
                assert q.shape == (m, 1, nq) and kk.shape == v.shape == (m, 1, nk) and q.dtype == dtype
                got = np.concatenate([np.array(t.astype(mx.float32)).reshape(m, -1) for t in (q, kk, v)], axis=1)
                assert np.array_equal(got[:, nq + nk :], y[:, nq + nk :]), f"v, M={m}"
                angle = np.array(positions)[:, None].astype(np.float64) * np.array(inv_freq)[None, :]
                c, s = (
                    np.tile(np.cos(angle), (1, (nq + nk) // head_dim)),
                    np.tile(np.sin(angle), (1, (nq + nk) // head_dim)),
                )
                a = y[:, : nq + nk].reshape(m, -1, 2, half)[:, :, 0].reshape(m, -1)
                b = y[:, : nq + nk].reshape(m, -1, 2, half)[:, :, 1].reshape(m, -1)
                turned = [(a * c - b * s).reshape(m, -1, half), (b * c + a * s).reshape(m, -1, half)]
                want = np.stack(turned, axis=2).reshape(m, -1)  # (each head: its pairs d, d + half)
                ulp = 2.0**-8 if dtype == mx.bfloat16 else 2.0**-11
                bound = ulp * (np.abs(want) + np.abs(a).max()) + 1e-6
                assert (np.abs(got[:, : nq + nk] - want) <= bound).all(), f"q/k, M={m}"
                if not mx.any(positions).item():
                    assert np.array_equal(got[:, : nq + nk], y[:, : nq + nk]), f"q/k at position 0, M={m}"
        assert not mx.any(qmm.counters(w, -1, 1)).item()
    finally:
        qmm.tail_args.cache_clear()
        qmm.launch_args.cache_clear()


@needs_cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "fp16"])
def test_the_swiglu_and_residual_tails_are_the_product_then_the_op(monkeypatch, dtype):
    """MLXCEL_QMM_OWN_OUTPUT's swiglu tail against silu(gate) * up of the same launch's product (its blocks take gate
    rows and the up rows below them, each row summed as in the plain launch): within a rounding; its residual tail
    against a separate add of the product: equal."""
    monkeypatch.setenv("MLXCEL_QMM_OWN_OUTPUT", "1")
    for clear in (qmm.tail_args.cache_clear, qmm.launch_args.cache_clear):
        clear()
    width, k = 1024, 2048
    x, w, scales, biases = make_operands(64, 2 * width, k, dtype, seed=21)
    try:
        for m in (9, 33, 64):
            xs = x[:m].reshape(m, 1, k)
            y = qmm.quantized_matmul(xs, w, scales, biases, 64)
            g, u = (np.array(t.astype(mx.float32)).reshape(m, -1) for t in (y[..., :width], y[..., width:]))
            want = g / (1 + np.exp(-g.astype(np.float64))) * u
            got = np.array(qmm.swiglu(xs, w, scales, biases, 64).astype(mx.float32)).reshape(m, -1)
            ulp = 2.0**-8 if dtype == mx.bfloat16 else 2.0**-11
            assert (np.abs(got - want) <= ulp * np.abs(want) + 1e-6).all(), f"swiglu, M={m}"
            residual = (mx.random.normal(y.shape, key=mx.random.key(m)) * 4).astype(dtype)
            summed = qmm.residual_product(xs, w, scales, biases, 64, residual)
            assert summed.shape == y.shape and mx.array_equal(summed, residual + y).item(), f"residual, M={m}"
        assert not mx.any(qmm.counters(w, -2, 1)).item() and not mx.any(qmm.counters(w, -3, 1)).item()
    finally:
        for clear in (qmm.tail_args.cache_clear, qmm.launch_args.cache_clear):
            clear()
