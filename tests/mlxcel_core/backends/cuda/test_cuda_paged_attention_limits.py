"""The CUDA paged-decode kernel's per-layer limits against the MLX-ops path, on a CUDA device: a sliding window, Llama
4's chunk, gpt-oss's attention sinks and Gemma 2's soft-capping, in every launch form (one split, two launches, the last
block combining, with the step's keys and values). Skipped without CUDA (tests/cuda_paged_cases.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from cuda_paged_cases import SPLITS, TOL, make_case, max_err, needs_cuda, ops_reference, step_kv

from mlxcel_core.backends.cuda.paged_attention import cuda_paged_decode_attention


def assert_every_launch_form(case, ref, kwargs, dtype, rowless=None):
    """The kernel gives `ref` at every split count, as two launches and with the last block combining; `rowless`: a
    row without keys, whose output must be zeros."""
    counters = mx.zeros((4096,), mx.int32)
    for s in SPLITS:
        for form in ({"_two_launches": True}, {"counters": counters}):
            out = cuda_paged_decode_attention(*case, num_splits=s, **kwargs, **form)
            if rowless is not None:
                assert mx.all(out[rowless] == 0).item()
            err = max_err(out, ref)
            assert err <= TOL[dtype], f"num_splits={s} {list(form)}: max abs error {err:.3g}"


def assert_with_the_steps_kv(case, kwargs, dtype, splits=(3,)):
    """Given the step's keys and values, the kernel writes them into the pools and attends to them as the ops path
    does over the pools it wrote."""
    q, k_pool, v_pool, table, lens = case
    k, v, blocks, offsets = step_kv(case)
    pools = [p * 1 for p in (k_pool, v_pool)]
    mx.eval(pools, k, v, blocks, offsets)
    for s in splits:
        out = cuda_paged_decode_attention(
            q, *pools, table, lens, num_splits=s, new_kv=(k, v, blocks, offsets), **kwargs
        )
        mx.eval(out)  # (the launch writes the step's keys and values into the pools the reference then reads)
        assert max_err(out, ops_reference(q, *pools, table, lens, **kwargs)) <= TOL[dtype]


@needs_cuda
@pytest.mark.parametrize(
    "limit",
    [("window", 1), ("window", 5), ("window", 100), ("window", 4096), ("chunk", 1), ("chunk", 32), ("chunk", 100)],
)
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_a_window_or_a_chunk_reads_its_keys_only(limit, dtype):
    """`window` (the row's last positions) and `chunk` (the row's own chunk): the kernel's splits cut only those keys
    (rows shorter and longer than them), in every launch form: two launches, the last block combining (counters), and
    with the step's keys and values."""
    kwargs = dict([limit])
    case = make_case([1, 33, 64, 300], 32, 8, 2, 64, dtype)
    ref = ops_reference(*case, num_splits=1, **kwargs)
    assert limit[1] >= 300 or max_err(ref, ops_reference(*case, num_splits=1)) > TOL[dtype]  # the limit matters
    assert_every_launch_form(case, ref, kwargs, dtype)
    assert_with_the_steps_kv(case, kwargs, dtype)


@needs_cuda
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_sinks_join_the_softmax_where_the_output_is_normalized(window, dtype):
    """`sinks` [Hq] (gpt-oss): the kernel's output is the ops path's with the sinks, in every launch form (one split,
    two launches, the last block combining, with the step's keys and values); a row without keys gives zeros."""
    case = make_case([0, 1, 33, 300], 32, 8, 2, 64, dtype)
    sinks = mx.array(np.linspace(-3.0, 4.0, 8).astype(np.float32)).astype(dtype)
    kwargs = {"sinks": sinks, "window": window}
    ref = ops_reference(*case, num_splits=1, **kwargs)
    assert max_err(ref, ops_reference(*case, num_splits=1, window=window)) > TOL[dtype]  # the sinks matter
    assert_every_launch_form(case, ref, kwargs, dtype, rowless=0)
    assert_with_the_steps_kv(make_case([1, 33, 64, 300], 32, 8, 2, 64, dtype), kwargs, dtype, splits=(1, 3))


@needs_cuda
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_softcapped_scores(window, dtype):
    """`softcap` (Gemma 2): the kernel caps each score as the ops path does, in every launch form."""
    q, k_pool, v_pool, table, lens = make_case([1, 33, 300], 32, 8, 2, 64, dtype)
    case = (q * 4, k_pool, v_pool, table, lens)  # (scores well past the cap)
    kwargs = {"softcap": 1.5, "window": window}
    ref = ops_reference(*case, num_splits=1, **kwargs)
    assert max_err(ref, ops_reference(*case, num_splits=1, window=window)) > TOL[dtype]  # the cap matters
    assert_every_launch_form(case, ref, kwargs, dtype)
