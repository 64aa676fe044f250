"""kernels/greedy.py: each row's argmax and its NaN readout, the CUDA kernel against MLX's ops; the masked form
(a constrained row's) against the argmax of the allowed tokens.

The kernel tests are skipped where MLX has no usable CUDA backend; the ops path (what runs there) is checked
everywhere. On the device: python -m pytest tests/mlxcel_core/kernels/test_greedy.py
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxcel_core.backends.cuda.kernels import greedy
from mlxcel_core.backends.cuda.kernels.greedy import greedy_tokens, kernel_runs, masked_greedy_tokens
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


def _masks(x: np.ndarray, extra_words: int = 0, seed: int = 0) -> np.ndarray:
    """Packed masks [n, words] allowing ~30% of the tokens, the row's maximum never among them; row 3's NaN (where
    there is a row 3) is allowed, and a NaN put into row 0 is not; bits past the vocabulary set (a tokenizer's ids
    beyond the logits)."""
    n, v = x.shape
    rng = np.random.default_rng(seed)
    allowed = rng.random((n, v)) < 0.3
    allowed[np.arange(n), np.nanargmax(np.where(np.isinf(x), 0, x), axis=-1)] = False
    allowed[:, min(3, v - 1)] = True  # every row allows something
    if n > 3:
        allowed[3] |= np.isnan(x[3])
    x[0, v // 2] = np.nan
    allowed[0, v // 2] = False
    words = (v + 31) // 32 + extra_words
    bits = np.zeros((n, words * 32), dtype=bool)
    bits[:, :v] = allowed
    bits[:, v:] = True
    return (
        np.packbits(bits.reshape(n, words, 32)[:, :, ::-1], axis=-1)
        .view(">u4")
        .astype(np.uint32)
        .view(np.int32)
        .reshape(n, words)
    )


def _check_masked(x: np.ndarray, bitmask: np.ndarray, dtype) -> None:
    """Each row's token is its first largest allowed logit and the readout that token, or -1 where an allowed logit
    is NaN; a row whose allowed logits are all -inf may give any token (the kernel an allowed one, the ops the
    argmax of an all -inf row)."""
    n, v = x.shape
    unpacked = ((bitmask[:, :, None] >> np.arange(32)) & 1).reshape(n, -1)[:, :v].astype(bool)
    want_tokens, want_readout = _expected(np.where(unpacked, x, -np.inf))
    tokens, readout = masked_greedy_tokens(mx.array(x).astype(dtype), mx.array(bitmask))
    got_tokens, got_readout = tokens.tolist(), readout.tolist()
    for row in range(n):
        if want_readout[row] < 0:
            assert got_readout[row] == -1, f"row {row}"
        elif not np.isfinite(x[row][unpacked[row]]).any():
            assert got_readout[row] == got_tokens[row], f"row {row}"
        else:
            assert got_tokens[row] == got_readout[row] == want_tokens[row], f"row {row}"
            assert unpacked[row, got_tokens[row]]


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("v", [1000, 4096])
def test_masked_tokens_are_the_allowed_argmax(dtype, v):
    """The ops path everywhere; on a CUDA device, the kernel."""
    x = _tricky(v, dtype)
    _check_masked(x, _masks(x, extra_words=2), dtype)


@needs_cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("v", [128256, 49152, 1001, 7])
def test_masked_kernel_matches_the_allowed_argmax(dtype, v):
    assert kernel_runs(mx.zeros((1, v), dtype=dtype))
    x = _tricky(v, dtype)
    _check_masked(x, _masks(x, seed=v), dtype)
    one = _logits(1, v, dtype, seed=2)
    _check_masked(one, _masks(one, extra_words=1, seed=3), dtype)
