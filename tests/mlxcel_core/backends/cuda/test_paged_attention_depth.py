"""The experiment MLXCEL_PAGED_MMA_DEPTH (settings.py; issue 42): the paged decode kernel's tensor-core body with 3 or
4 tiles of keys and values in registers a warp instead of 2. The tiles are taken in the same order at every depth
(test_paged_attention_mma.py follows each depth's loop), so on a CUDA device the outputs are those of depth 2 bit
for bit; the Llama-3-8B kernel compiles without spills at every depth."""

from __future__ import annotations

import re

import mlx.core as mx
import pytest
from cuda_compile import compile_sm90, kernel_file, needs_nvcc
from cuda_paged_cases import make_case, needs_cuda, step_kv

from mlxcel_core.backends.cuda import paged_attention as cpa
from mlxcel_core.backends.cuda.paged_attention import cuda_paged_decode_attention, launch_geometry


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


@needs_nvcc
@pytest.mark.parametrize("depth", [3, 4])
def test_the_llama_kernel_compiles_without_spills_at_each_depth(tmp_path, depth):
    """Llama-3-8B's decode kernel as a step launches it, two blocks of 128 threads an SM at most (255 registers a
    thread: the body's keys and values take 32 a tile)."""
    source = cpa.kernel_source(False, True, True, False, True, depth=depth)
    assert f"base += {depth} * STEP" in source
    geo = launch_geometry(128, 4, True)
    template = {
        **{"KV": mx.bfloat16, "SCALE_BITS": cpa._scale_bits(128**-0.5), "D": 128, "BS": 32, "HKV": 8, "NREP": 4},
        **{"G": geo["G"], "LPT": geo["LPT"], "EPL": geo["EPL"], "TPB": cpa.THREADS},
        **{"UNROLL": cpa.UNROLL, "WINDOW": 0, "CHUNK": 0, "SOFTCAP_BITS": 0, "OUT": mx.bfloat16},
    }
    params = []
    for name in (*cpa.INPUTS, *cpa.NEW_KV_INPUTS, "counters"):
        kind = "__nv_bfloat16" if name in ("q", "k_pool", "v_pool", "k_new", "v_new") else "int32_t"
        params.append(f"    const {kind}* {name}")
        if f"{name}_shape" in source:
            params.append(f"    const __grid_constant__ Shape {name}_shape")
    params += ["    __nv_bfloat16* out"] + [f"    float* {n}" for n in ("o_part", "m_part", "l_part")]
    report = compile_sm90(tmp_path, kernel_file("paged_decode", params, template, source, cpa.MMA_HEADER))
    assert int(re.search(r"Used (\d+) registers", report).group(1)) <= 255, report
