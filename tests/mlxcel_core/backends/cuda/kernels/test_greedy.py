"""kernels/greedy.py: each row's argmax and its NaN readout, the CUDA kernel against MLX's ops.

The kernel tests are skipped where MLX has no usable CUDA backend; the ops path (what runs there) is checked
everywhere. On the device: python -m pytest tests/mlxcel_core/kernels/test_greedy.py
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxcel_core.backends.cuda.kernels import greedy
from mlxcel_core.backends.cuda.kernels.greedy import greedy_tokens, kernel_runs
from mlxcel_core.backends.cuda.paged_attention import cuda_kernel_available

needs_cuda = pytest.mark.skipif(not cuda_kernel_available(), reason="needs MLX's CUDA backend and a CUDA device")


def _logits(n: int, v: int, dtype, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, v)).astype(np.float32) * 4
    return np.array(mx.array(x).astype(dtype).astype(mx.float32))  # representable in dtype


def _expected(x: np.ndarray) -> tuple[list[int], list[int]]:
    """First index of each row's maximum; readout -1 for rows with a NaN (their token is not defined)."""
    nan = np.isnan(x).any(axis=-1)
    tokens = np.where(nan, -1, np.argmax(np.where(np.isnan(x), -np.inf, x), axis=-1))
    return tokens.tolist(), np.where(nan, -1, tokens).tolist()


def _check(x: np.ndarray, dtype) -> None:
    tokens, readout = greedy_tokens(mx.array(x).astype(dtype))
    assert tokens.dtype == mx.uint32 and readout.dtype == mx.int32 and tokens.shape == readout.shape == (len(x),)
    want_tokens, want_readout = _expected(x)
    assert readout.tolist() == want_readout
    got = tokens.tolist()
    for row, want in enumerate(want_tokens):
        if want >= 0:
            assert got[row] == want, f"row {row}"
        else:  # a NaN row ends; its token is still a valid input id for the lookahead step
            assert 0 <= got[row] < x.shape[1]


def _tricky(v: int, dtype) -> np.ndarray:
    """Rows: random; a tie of the maximum far apart (first wins); a tie in neighbouring elements; a NaN; all -inf;
    the maximum in the last element."""
    x = _logits(6, v, dtype, seed=v)
    x[1, v // 3] = x[1, v - 2] = 50.0
    x[2, 5 % v] = x[2, min(6, v - 1)] = 60.0
    x[3, v // 2] = np.nan
    x[4, :] = -np.inf
    x[5, -1] = 70.0
    return x


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32], ids=["bf16", "fp32"])
def test_tokens_and_readout_where_the_ops_run(dtype):
    if kernel_runs(mx.zeros((1, 8))):
        pytest.skip("the kernel runs here: the kernel tests below cover it")
    _check(_tricky(1000, dtype), dtype)


def test_kernel_runs_only_on_a_cuda_device_for_float_matrices():
    assert kernel_runs(mx.zeros((2, 8))) == (cuda_kernel_available() and mx.default_device() == mx.gpu)
    assert not kernel_runs(mx.zeros((8,)))
    assert not kernel_runs(mx.zeros((2, 8), dtype=mx.int32))


@needs_cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("v", [128256, 151936, 49152, 1001, 7])
def test_kernel_matches_argmax_and_readout(dtype, v):
    assert kernel_runs(mx.zeros((1, v), dtype=dtype))
    _check(_tricky(v, dtype), dtype)
    _check(_logits(1, v, dtype, seed=1), dtype)


@needs_cuda
def test_kernel_on_unaligned_rows():
    """A row-contiguous view starting one element in (16-byte loads cannot be used): the scalar path."""
    x = _tricky(4099, mx.bfloat16)
    flat = mx.concatenate([mx.zeros((1,)), mx.array(x.reshape(-1))]).astype(mx.bfloat16)
    view = flat[1:].reshape(x.shape)
    tokens, readout = greedy_tokens(view)
    want_tokens, want_readout = _expected(x)
    assert readout.tolist() == want_readout
    assert [t for t, w in zip(tokens.tolist(), want_tokens) if w >= 0] == [w for w in want_tokens if w >= 0]


@needs_cuda
def test_kernel_inside_a_compiled_step():
    step = mx.compile(lambda logits: greedy_tokens(logits * 1.0))
    x = _tricky(32000, mx.bfloat16)
    tokens, readout = step(mx.array(x).astype(mx.bfloat16))
    assert readout.tolist() == _expected(x)[1]
    assert greedy._kernel() is greedy._kernel()  # one compiled kernel object
