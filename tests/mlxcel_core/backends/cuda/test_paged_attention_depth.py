"""The experiment MLXCEL_PAGED_MMA_DEPTH (settings.py; issue 42): the paged decode kernel's tensor-core body with 3 or
4 tiles of keys and values in registers a warp instead of 2. The tiles are taken in the same order at every depth
(test_paged_attention_mma.py follows each depth's loop), so on a CUDA device the outputs are those of depth 2 bit
for bit (test_cuda_paged_attention.py compiles the Llama-3-8B kernel at each depth without spills)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from cuda_paged_cases import make_case, needs_cuda, step_kv

from mlxcel_core.backends.cuda import paged_attention as cpa
from mlxcel_core.backends.cuda.paged_attention import cuda_paged_decode_attention


def _outputs(monkeypatch, depth: int) -> list[mx.array]:
    monkeypatch.setenv("MLXCEL_PAGED_MMA_DEPTH", str(depth))
    cpa._kernel.cache_clear()  # (the setting is read where a kernel is built)
    outs = []
    for dtype in (mx.bfloat16, mx.float16):
        case = make_case([1, 7, 100, 333, 2048, 5000], 32, 32, 8, 128, dtype)
        q, k_pool, v_pool, table, lens = case
        counters = mx.zeros((cpa.COUNTERS,), mx.int32)
        mx.eval(counters)
        for splits in (1, 3, 16):
            outs.append(cuda_paged_decode_attention(*case, num_splits=splits))
            outs.append(cuda_paged_decode_attention(*case, num_splits=splits, counters=counters))
        pools = [p * 1 for p in (k_pool, v_pool)]
        outs.append(cuda_paged_decode_attention(q, *pools, table, lens, num_splits=4, new_kv=step_kv(case)))
        mx.eval(outs)
    return outs


@needs_cuda
@pytest.mark.parametrize("depth", [3, 4])
def test_each_depth_gives_depth_twos_outputs_bit_for_bit(monkeypatch, depth):
    try:
        want = _outputs(monkeypatch, 2)
        got = _outputs(monkeypatch, depth)
    finally:
        cpa._kernel.cache_clear()
    assert len(got) == len(want) and all(mx.array_equal(a, b).item() for a, b in zip(got, want))
