"""The experiment MLXCEL_QMM_W16 (kernels/qmm_w16.py): the 4-bit batch kernel with each weight made whole in 16 bits
before the tensor-core product. Without a GPU: the setting picks the kernel's text and name (and the tuning cache's
runner), every edit takes, and the text compiles for sm_90 within two blocks an SM. On CUDA: its products, 6..64
rows, within the kernel's bound (test_qmm.py) of a reference whose weights are rounded once to x's type as its are
(against unrounded weights that rounding alone is ~1e-4 of |x| @ |W|.T in bfloat16, five times the bound)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import mlx.core as mx
import pytest
from cuda_compile import compile_sm90, needs_nvcc
from test_qmv import check_close, make_operands, needs_cuda, reference

from mlxcel_core.backends.cuda.kernels import qmm, qmm_w16
from mlxcel_core.backends.cuda.kernels.cubin_cache import kernel_text


@pytest.fixture
def built(monkeypatch):
    """qmm._kernel() with a stand-in for MLX's cuda_kernel (its arguments), its cache cleared before and after."""
    monkeypatch.setattr(qmm, "cuda_kernel", lambda **kwargs: SimpleNamespace(**kwargs))
    qmm._kernel.cache_clear()
    yield lambda: qmm._kernel()
    qmm._kernel.cache_clear()


def test_the_setting_builds_the_experiments_kernel(monkeypatch, built):
    from autotune.matvec_ops import QMM, runner

    monkeypatch.delenv("MLXCEL_QMM_W16", raising=False)
    kernel = built()
    assert (kernel.name, kernel.source) == (qmm.KERNEL_NAME, qmm.kernel_source()[1])
    assert runner(QMM) == f"cuda-kernel-{qmm.KERNEL_NAME}"
    monkeypatch.setenv("MLXCEL_QMM_W16", "1")
    qmm._kernel.cache_clear()
    kernel = built()
    assert kernel.name == qmm.W16_KERNEL_NAME != qmm.KERNEL_NAME
    assert (kernel.header, kernel.source) == (qmm_w16.W16_FULL_HEADER, qmm_w16.W16_SOURCE) == qmm.kernel_source()
    assert runner(QMM) == f"cuda-kernel-{qmm.W16_KERNEL_NAME}"  # (winners tuned on the kernel are misses)


def test_every_edit_takes_once():
    source = qmm_w16.W16_SOURCE
    assert "mlxcel_qmm_scale_sums" not in source and "xsum[c & 1][gc][m]" not in source
    assert source.count("mlxcel_qmm_w16<T>(") == 4 and "float (&acc)[NT][4] = tot;" in source
    assert "__byte_perm" in source  # (the block's pass still reorders x)
    with pytest.raises(RuntimeError, match="no longer has"):
        qmm_w16._edited(source)  # (its edits are gone from its own text)


@needs_nvcc
@pytest.mark.parametrize("m", [8, 32, 64])
def test_the_kernel_fits_two_blocks_an_sm_without_spills(tmp_path, monkeypatch, built, m):
    monkeypatch.setenv("MLXCEL_QMM_W16", "1")
    kernel = built()
    args = qmm.launch_args((m, 4096), mx.bfloat16, mx.bfloat16, 14336, 4096, 64)
    dtypes = [mx.bfloat16, mx.uint32, mx.bfloat16, mx.bfloat16]
    text = kernel_text(
        "k", kernel.source, kernel.header, kernel.input_names, dtypes, [2, 2, 2, 2], ["partial"], [mx.float32],
        args["template"], launch_bounds=kernel.launch_bounds,
    )  # fmt: skip
    report = compile_sm90(tmp_path, text)
    assert int(re.search(r"Used (\d+) registers", report).group(1)) <= 128, report


@needs_cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("n,k,group_size", [(4096, 4096, 64), (1000, 512, 32), (333, 1024, 128)])
def test_products_match_the_reference(monkeypatch, dtype, n, k, group_size):
    monkeypatch.setenv("MLXCEL_QMM_W16", "1")
    qmm._kernel.cache_clear()
    try:
        x, w, scales, biases = make_operands(64, n, k, dtype, group_size=group_size, seed=n)
        ref, mag = reference(x, w, scales, biases, group_size, weights_in=dtype)  # (its one rounding a weight)
        for m in (6, 8, 9, 32, 40, 64):
            y = qmm.quantized_matmul(x[:m], w, scales, biases, group_size)
            assert y.dtype == dtype and y.shape == (m, n)
            check_close(y, ref[:m], mag[:m], dtype, f"w16 M={m} N={n} K={k}")
    finally:
        qmm._kernel.cache_clear()
