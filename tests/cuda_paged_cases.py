"""Shared pieces of the CUDA paged-decode kernel's tests (tests/mlxcel_core/backends/cuda/test_cuda_paged_attention*):
random pooled cases, the ops-path reference on the CPU stream, the tolerances. A plain module, as tiny_models."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from mlxcel_core.backends.cuda.paged_attention import cuda_kernel_available
from mlxcel_core.kv.paged_attention import paged_decode_attention

needs_cuda = pytest.mark.skipif(not cuda_kernel_available(), reason="needs MLX's CUDA backend and a CUDA device")

TOL = {mx.float16: 1e-3, mx.float32: 1e-5, mx.bfloat16: 8e-3}
SPLITS = [1, 2, 4, 8, 16, 32]


def make_case(lens, block_size, hq, hkv, d, dtype, seed=0, extra_width=1):
    """Random pools (values in [-1, 1]), shuffled non-overlapping block tables padded with 0 entries."""
    rng = np.random.default_rng(seed)
    need = [math.ceil(n / block_size) for n in lens]
    width = max(need + [1]) + extra_width
    num_blocks = sum(need) * 2 + 3
    shape = (num_blocks, block_size, hkv, d)
    k_pool = mx.array(rng.uniform(-1, 1, shape).astype(np.float32)).astype(dtype)
    v_pool = mx.array(rng.uniform(-1, 1, shape).astype(np.float32)).astype(dtype)
    ids = rng.permutation(num_blocks)
    table = np.zeros((len(lens), width), np.int32)
    start = 0
    for b, n in enumerate(need):
        table[b, :n] = ids[start : start + n]
        start += n
    q = mx.array(rng.uniform(-1, 1, (len(lens), hq, d)).astype(np.float32)).astype(dtype)
    lens = mx.array(np.array(lens, np.int32))
    mx.eval(q, k_pool, v_pool)
    return q, k_pool, v_pool, mx.array(table), lens


def max_err(a, b) -> float:
    return mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()


def ops_reference(*case, **kwargs):
    """The ops path in plain float32 arithmetic (CPU stream)."""
    with mx.stream(mx.cpu):
        out = paged_decode_attention(*case, **kwargs)
        mx.eval(out)
    return out


def step_kv(case, seed=1):
    """A decode step's own keys and values [B, Hkv, D] and each row's slot: its last position's place in its table
    (every row here has at least one token)."""
    q, k_pool, v_pool, table, lens = case
    rng = np.random.default_rng(seed)
    B, (_, bs, hkv, d) = q.shape[0], k_pool.shape
    k = mx.array(rng.uniform(-1, 1, (B, hkv, d)).astype(np.float32)).astype(k_pool.dtype)
    v = mx.array(rng.uniform(-1, 1, (B, hkv, d)).astype(np.float32)).astype(k_pool.dtype)
    last = np.array(lens) - 1
    blocks = mx.array(np.array(table)[np.arange(B), last // bs].astype(np.int32))
    return k, v, blocks, mx.array((last % bs).astype(np.int32))
