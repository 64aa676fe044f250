"""The CUDA paged-decode kernel vs the MLX-ops path (the reference contract), on a CUDA device.

The kernel tests are skipped where MLX has no usable CUDA backend (CPU, Apple silicon); the launch
geometry and the combine step are checked everywhere. On the device:
    python -m pytest tests/mlxcel_core/backends/cuda/test_cuda_paged_attention.py
The reference is the ops path on the CPU stream: on CUDA, MLX runs float32 matmuls as TF32 unless
MLX_ENABLE_TF32=0 (measured here: 2.4e-4 off for a one-token context), so the GPU ops path is not a
float32 reference; the kernel itself accumulates in plain float32.
Acceptance: max-abs error <= 1e-3 in float16 and <= 1e-5 in float32 against the ops path, for every
cell of `mlxcel tune`'s default matrix (Llama-3-8B geometry: Hq 32, Hkv 8, D 128, block 32; batch 1..8;
context 1024..16384), for other geometries (MHA, MQA, head dims 64/80/96/256, block 16), for context
lengths that are not multiples of the block size, and for every split count a tuner may pick.
"""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest
from cuda_compile import compile_sm90, kernel_file, needs_nvcc
from cuda_paged_cases import SPLITS, TOL, make_case, max_err, needs_cuda, ops_reference, step_kv
from tiny_models import save_tiny_llama

from mlxcel_core.backends.cuda import paged_attention as cpa
from mlxcel_core.backends.cuda.paged_attention import (
    RUNNER_CUDA,
    combine_partials,
    cuda_paged_decode_attention,
    launch_geometry,
    runner_for,
)


def check(case, dtype, splits=SPLITS, scale=None):
    ref = ops_reference(*case, num_splits=1, scale=scale)
    for s in splits:
        out = cuda_paged_decode_attention(*case, num_splits=s, scale=scale)
        assert out.shape == ref.shape and out.dtype == ref.dtype
        assert mx.all(mx.isfinite(out)).item(), f"num_splits={s}: non-finite output"
        err = max_err(out, ref)
        assert err <= TOL[dtype], f"num_splits={s}: max abs error {err:.3g} > {TOL[dtype]}"


@needs_cuda
def test_runner_is_the_kernel():
    assert runner_for(128) == RUNNER_CUDA


# The default matrix of `mlxcel tune` (Llama-3-8B geometry); no row's length is a multiple of the block size
# (row 0 is 5 tokens short of the cell's context, the others shorter still).
@needs_cuda
@pytest.mark.parametrize("dtype", [mx.float16, mx.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("context", [1024, 4096, 16384, 32768])
@pytest.mark.parametrize("batch", [1, 2, 4, 8])
def test_default_matrix_llama3_8b(batch, context, dtype):
    lens = [context - (0 if b == 0 else 32 * b + 7) for b in range(batch)]
    lens[0] = context - 5  # not a multiple of 32
    check(make_case(lens, 32, 32, 8, 128, dtype, seed=batch * 7 + context), dtype)


@needs_cuda
@pytest.mark.parametrize("dtype", [mx.float16, mx.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize(
    "hq,hkv,d,block_size",
    [
        (32, 8, 128, 16),  # GQA, small blocks
        (16, 16, 64, 32),  # MHA
        (32, 1, 128, 32),  # MQA: query heads split over several blocks per kv head
        (14, 2, 64, 32),  # n_rep 7
        (32, 8, 80, 32),  # head dim not a multiple of the lanes' share (no vector loads)
        (24, 8, 96, 32),
        (16, 4, 256, 32),
        (8, 2, 32, 8),
    ],
)
def test_geometries(hq, hkv, d, block_size, dtype):
    lens = [1, 31, block_size + 1, 1000, 2049]
    check(make_case(lens, block_size, hq, hkv, d, dtype, seed=hq + d), dtype, splits=SPLITS + [3, 7])


@needs_cuda
def test_bfloat16():
    case = make_case([5, 777, 4097], 32, 32, 8, 128, mx.bfloat16)
    check(case, mx.bfloat16)


@needs_cuda
def test_more_splits_than_tokens_and_empty_rows():
    for dtype in (mx.float16, mx.float32):
        case = make_case([0, 1, 2, 3, 40], 32, 8, 2, 128, dtype, extra_width=3)
        check(case, dtype, splits=[1, 2, 5, 32, 64])
        out = cuda_paged_decode_attention(*case, num_splits=8)
        assert mx.all(out[0] == 0).item()  # an empty row gives zeros, like the ops path


@needs_cuda
def test_context_len_past_the_table_is_clamped():
    q, k_pool, v_pool, table, lens = make_case([40, 70], 32, 8, 2, 64, mx.float32)
    too_long = mx.array([10_000, 70], dtype=mx.int32)
    ref = ops_reference(q, k_pool, v_pool, table, too_long)
    assert max_err(cuda_paged_decode_attention(q, k_pool, v_pool, table, too_long, num_splits=4), ref) <= 1e-5


@needs_cuda
def test_custom_scale_int64_tables_and_fp32_query_on_fp16_pools():
    q, k_pool, v_pool, table, lens = make_case([100, 333], 32, 8, 2, 128, mx.float16)
    check((q, k_pool, v_pool, table.astype(mx.int64), lens.astype(mx.int64)), mx.float16, splits=[1, 4], scale=0.3)
    q32 = q.astype(mx.float32)
    ref = ops_reference(q32, k_pool, v_pool, table, lens)
    out = cuda_paged_decode_attention(q32, k_pool, v_pool, table, lens, num_splits=4)
    assert out.dtype == mx.float32 and max_err(out, ref) <= 1e-5


@needs_cuda
def test_one_token_query_layout():
    q, k_pool, v_pool, table, lens = make_case([100, 333], 32, 8, 2, 64, mx.bfloat16)
    flat = cuda_paged_decode_attention(q, k_pool, v_pool, table, lens, num_splits=4)
    out = cuda_paged_decode_attention(q[:, :, None, :], k_pool, v_pool, table, lens, num_splits=4)
    assert out.shape == (2, 8, 1, 64) and mx.array_equal(out.reshape(flat.shape), flat).item()


@needs_cuda
def test_one_split_is_one_launch_with_the_two_launch_values():
    """num_splits=1 runs one kernel that writes the output itself: bit for bit what split + combine give (the
    combine's rescale factor is exactly 1 there), empty rows zeros, both query layouts."""
    for dtype in (mx.bfloat16, mx.float16, mx.float32):
        q, k_pool, v_pool, table, lens = make_case([0, 1, 100, 333], 32, 8, 2, 64, dtype)
        one = cuda_paged_decode_attention(q, k_pool, v_pool, table, lens, num_splits=1)
        two = cuda_paged_decode_attention(q, k_pool, v_pool, table, lens, num_splits=1, _two_launches=True)
        assert one.dtype == dtype and mx.array_equal(one, two).item()
        assert mx.all(one[0] == 0).item()
        heads_first = cuda_paged_decode_attention(q[:, :, None, :], k_pool, v_pool, table, lens, num_splits=1)
        assert heads_first.shape == (4, 8, 1, 64) and mx.array_equal(heads_first.reshape(one.shape), one).item()


@needs_cuda
@pytest.mark.parametrize("splits", [1, 3, 16])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_the_steps_keys_and_values_written_in_the_kernel(splits, dtype):
    """new_kv: the kernel writes the step's keys/values into the pools in place and attends to them: the same output
    as the ops path's scatter (write_kv) then attention, and the pools hold exactly what the scatter wrote."""
    from mlxcel_core.kv.paged_attention import write_kv

    case = make_case([1, 33, 64, 300], 32, 8, 2, 64, dtype)
    q, k_pool, v_pool, table, lens = case
    k, v, blocks, offsets = step_kv(case)
    mx.eval(k, v, blocks, offsets)
    slots = blocks * 32 + offsets
    with mx.stream(mx.cpu):
        k_ref, v_ref = write_kv(k_pool, v_pool, slots, k, v)
        mx.eval(k_ref, v_ref)
    ref = ops_reference(q, k_ref, v_ref, table, lens)
    pools = [p * 1 for p in (k_pool, v_pool)]  # the kernel's own copies (new buffers), written in place
    mx.eval(pools)
    out = cuda_paged_decode_attention(q, *pools, table, lens, num_splits=splits, new_kv=(k, v, blocks, offsets))
    mx.eval(out)
    assert max_err(out, ref) <= TOL[dtype]
    assert mx.array_equal(pools[0], k_ref).item() and mx.array_equal(pools[1], v_ref).item()
    again = cuda_paged_decode_attention(q, *pools, table, lens, num_splits=splits)  # reads the written slot back
    assert mx.array_equal(again, out).item()


def test_new_kv_is_checked():
    q, k_pool, v_pool, table, lens = make_case([10, 20], 32, 8, 2, 64, mx.float32)
    k, v = mx.zeros((2, 2, 64)), mx.zeros((2, 2, 64))
    with pytest.raises(ValueError, match="keys and values"):
        cpa._new_kv_inputs((k[:1], v, mx.zeros(2), mx.zeros(2)), k_pool, 2)
    with pytest.raises(ValueError, match="slot blocks"):
        cpa._new_kv_inputs((k, v, mx.zeros(3), mx.zeros(2)), k_pool, 2)
    inputs = cpa._new_kv_inputs((k.astype(mx.float16), v, mx.zeros(2, mx.int64), mx.zeros(2)), k_pool, 2)
    assert [a.dtype for a in inputs] == [mx.float32, mx.float32, mx.int32, mx.int32]


_KINDS = ["split", "one_split", "last_block_combines", "one_split_sinks", "combines_sinks"]
_COMPILED = [(k, n, mma) for k in _KINDS for n in (False, True) for mma in (False, True)]


@needs_nvcc
@pytest.mark.parametrize("kind,new_kv,mma", _COMPILED)
def test_kernel_sources_compile_for_sm90_without_spills(tmp_path, kind, new_kv, mma):
    """The split kernel in its variants as MLX's cuda_kernel assembles them (Llama-3-8B geometry, bf16), with the
    lane groups' body and with the tensor cores'."""
    one_split, combines, sinks = kind.startswith("one_split"), "combines" in kind, kind.endswith("sinks")
    source = cpa.kernel_source(one_split, new_kv, combines, sinks, mma)
    geo = launch_geometry(128, 4, mma)
    template = {
        "KV": mx.bfloat16,
        "SCALE_BITS": cpa._scale_bits(128**-0.5),
        "D": 128,
        "BS": 32,
        "HKV": 8,
        "NREP": 4,
        "G": geo["G"],
        "LPT": geo["LPT"],
        "EPL": geo["EPL"],
        "TPB": cpa.THREADS,
        "UNROLL": cpa.UNROLL,
        "WINDOW": 4096,
        "CHUNK": 8192,
        "SOFTCAP_BITS": cpa.float32_bits(50.0),
    }
    if one_split or combines:
        template["OUT"] = mx.bfloat16
    types = {
        "q": "__nv_bfloat16",
        "k_pool": "__nv_bfloat16",
        "v_pool": "__nv_bfloat16",
        "k_new": "__nv_bfloat16",
        "v_new": "__nv_bfloat16",
        "sinks": "__nv_bfloat16",
    }
    params = []
    names = (*cpa.INPUTS, *(cpa.NEW_KV_INPUTS if new_kv else ()), *(("counters",) if combines else ()))
    for name in (*names, *(("sinks",) if sinks else ())):
        params.append(f"    const {types.get(name, 'int32_t')}* {name}")
        if f"{name}_shape" in source:
            params.append(f"    const __grid_constant__ Shape {name}_shape")
    params += ["    __nv_bfloat16* out"] if one_split or combines else []
    params += [] if one_split else [f"    float* {n}" for n in ("o_part", "m_part", "l_part")]
    assert ("k_pool_shape" in source) == new_kv and ("atomicAdd" in source) == combines
    assert ("sinks[" in source) == sinks and "/*" not in source.replace("/*NEW_KV*/", "")  # (every placeholder filled)
    compile_sm90(tmp_path, kernel_file("paged_decode", params, template, source, cpa.MMA_HEADER if mma else ""))


@needs_nvcc
@pytest.mark.parametrize("mma,depth,most", [(False, 2, 128), (True, 2, 168), (True, 3, 255), (True, 4, 255)])
def test_the_llama_kernel_fits_its_blocks_an_sm(tmp_path, mma, depth, most):
    """Llama-3-8B's decode kernel as a step launches it (the step's KV, last block combines; no window or soft cap):
    no spill, and at most 128 registers a thread (four blocks of 128 threads an SM) with the lane groups' body, 168
    (three) with the tensor cores' (two tiles of keys and values in flight a warp), 255 (two) with the experiment
    MLXCEL_PAGED_MMA_DEPTH's 3 or 4 tiles."""
    source = cpa.kernel_source(False, True, True, False, mma, depth=depth)
    assert f"base += {depth} * STEP" in source or not mma
    geo = launch_geometry(128, 4, mma)
    template = {
        **{"KV": mx.bfloat16, "SCALE_BITS": cpa._scale_bits(128**-0.5), "D": 128, "BS": 32, "HKV": 8, "NREP": 4},
        **{"G": geo["G"], "LPT": geo["LPT"], "EPL": geo["EPL"], "TPB": cpa.THREADS},
        **{"UNROLL": cpa.UNROLL, "WINDOW": 0, "CHUNK": 0, "SOFTCAP_BITS": 0, "OUT": mx.bfloat16},
    }
    params = []
    for name in (*cpa.INPUTS, *cpa.NEW_KV_INPUTS, "counters"):
        params.append(
            f"    const {'__nv_bfloat16' if name in ('q', 'k_pool', 'v_pool', 'k_new', 'v_new') else 'int32_t'}* {name}"
        )
        if f"{name}_shape" in source:
            params.append(f"    const __grid_constant__ Shape {name}_shape")
    params += ["    __nv_bfloat16* out"] + [f"    float* {n}" for n in ("o_part", "m_part", "l_part")]
    report = compile_sm90(tmp_path, kernel_file("paged_decode", params, template, source, cpa.MMA_HEADER * mma))
    assert int(re.search(r"Used (\d+) registers", report).group(1)) <= most, report


_NDIMS = {"q": 3, "k_pool": 4, "v_pool": 4, "block_tables": 2, "k_new": 3, "v_new": 3}


@needs_nvcc
@pytest.mark.parametrize("kind", ["split_combine", "one_split", "combines_sinks"])
@pytest.mark.parametrize("mma", [False, True])
def test_the_prefetch_experiment_compiles_chained_without_more_registers(tmp_path, kind, mma):
    """MLXCEL_PDL_PREFETCH's paged kernel as the kernel cache builds it with PDL: the split's first keys and values
    asked of L2, then the wait, then the step's own keys and values; no spill and no more registers than without it.
    Without PDL the prefetch is compiled out."""
    from mlxcel_core.backends.cuda.kernels.cubin_cache import kernel_text
    from mlxcel_core.backends.cuda.kernels.pdl_prefetch import PREFETCH_HELPER

    one_split, combines, sinks = kind == "one_split", kind != "one_split", kind.endswith("sinks")
    geo = launch_geometry(128, 4, mma)
    template = [
        *[("KV", mx.bfloat16), ("SCALE_BITS", cpa._scale_bits(128**-0.5)), ("D", 128), ("BS", 32), ("HKV", 8)],
        *[("NREP", 4), ("G", geo["G"]), ("LPT", geo["LPT"]), ("EPL", geo["EPL"]), ("TPB", cpa.THREADS)],
        *[("UNROLL", cpa.UNROLL), ("WINDOW", 0), ("CHUNK", 0), ("SOFTCAP_BITS", 0), ("OUT", mx.bfloat16)],
    ]
    names = [*cpa.INPUTS, *cpa.NEW_KV_INPUTS, *(["counters"] if combines else []), *(["sinks"] if sinks else [])]
    dtypes = [mx.bfloat16 if n in ("q", "k_pool", "v_pool", "k_new", "v_new", "sinks") else mx.int32 for n in names]
    outputs = ["out"] if one_split else ["out", "o_part", "m_part", "l_part"]
    out_dtypes = [mx.bfloat16] + [mx.float32] * (len(outputs) - 1)
    registers = {}
    for early, pdl in ((False, True), (True, True), (True, False)):
        source = cpa.kernel_source(one_split, True, combines, sinks, mma, early)
        header = cpa.MMA_HEADER * mma + PREFETCH_HELPER * early
        args = (names, dtypes, [_NDIMS.get(n, 1) for n in names], outputs, out_dtypes, template, pdl)
        text = kernel_text("k", source, header, *args)
        (tmp_path / f"{early}{pdl}").mkdir()
        report = compile_sm90(tmp_path / f"{early}{pdl}", text)
        registers[early, pdl] = int(re.search(r"Used (\d+) registers", report).group(1))
        if early and pdl:
            assert text.index("mlxcel_prefetch_l2_sectors(k_pool") < text.index("griddepcontrol.wait")
            assert text.index("griddepcontrol.wait") < text.index("constexpr bool NEW_KV = true;")
        elif early:
            assert "griddepcontrol" not in text and "#define PDL_EARLY 0" in text
    assert registers[True, True] <= registers[False, True], registers


def test_one_split_has_nothing_to_combine():
    with pytest.raises(ValueError, match="nothing to combine"):
        cpa.kernel_source(True, False, True)


@needs_cuda
@pytest.mark.parametrize("splits", [2, 3, 16])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32], ids=["bf16", "fp16", "f32"])
def test_last_block_combines_gives_the_two_launch_values(splits, dtype):
    """With counters, one launch whose last block per head group combines the splits: bit for bit the split +
    combine launches (the same arithmetic), empty rows zeros; the counters are zeros again after every launch, so
    launch after launch (with and without the step's own keys and values) gives the same values."""
    case = make_case([0, 1, 100, 333, 2048], 32, 8, 2, 64, dtype)
    q, k_pool, v_pool, table, lens = case
    counters = mx.zeros((cpa.COUNTERS,), mx.int32)
    mx.eval(counters)
    two = cuda_paged_decode_attention(*case, num_splits=splits)
    for _ in range(3):
        one = cuda_paged_decode_attention(*case, num_splits=splits, counters=counters)
        mx.eval(one)
        assert one.dtype == dtype and mx.array_equal(one, two).item(), max_err(one, two)
        assert mx.all(counters == 0).item() and mx.all(one[0] == 0).item()
    written = make_case([1, 33, 64, 300], 32, 8, 2, 64, dtype)
    kv = step_kv(written)
    pools = [p * 1 for p in written[1:3]]
    mx.eval(pools)
    ref = cuda_paged_decode_attention(written[0], *pools, *written[3:], num_splits=splits, new_kv=kv)
    fused = cuda_paged_decode_attention(
        written[0], *pools, *written[3:], num_splits=splits, new_kv=kv, counters=counters
    )
    assert mx.array_equal(fused, ref).item() and mx.all(counters == 0).item()
    too_few = mx.zeros((3,), mx.int32)  # fewer counters than rows x head groups: the two launches
    assert mx.array_equal(cuda_paged_decode_attention(*case, num_splits=splits, counters=too_few), two).item()
    odd = make_case([5, 200], 16, 4, 2, 18, dtype)  # a head dim the combine cannot read 4 at a time
    assert mx.array_equal(
        cuda_paged_decode_attention(*odd, num_splits=splits, counters=counters),
        cuda_paged_decode_attention(*odd, num_splits=splits),
    ).item()


@needs_cuda
def test_results_are_deterministic():
    case = make_case([3000, 1234], 32, 32, 8, 128, mx.float16)
    a = cuda_paged_decode_attention(*case, num_splits=8)
    b = cuda_paged_decode_attention(*case, num_splits=8)
    assert mx.array_equal(a, b).item()


@needs_cuda
def test_bad_input_is_a_value_error():
    q, k_pool, v_pool, table, lens = make_case([10], 32, 8, 2, 64, mx.float32)
    with pytest.raises(ValueError, match="num_splits"):
        cuda_paged_decode_attention(q, k_pool, v_pool, table, lens, num_splits=0)
    with pytest.raises(ValueError, match="multiple"):
        cuda_paged_decode_attention(q[:, :3], k_pool, v_pool, table, lens)


def test_launch_geometry_bounds_and_tuner_agrees():
    from autotune.ops import query_groups
    from mlxcel_core.backends.cuda.paged_attention_source import body_is_mma

    for d in (32, 64, 80, 96, 128, 256, 512):
        for n_rep in (1, 4, 7, 32):
            g = launch_geometry(d, n_rep)
            assert g["LPT"] * g["EPL"] >= d and g["G"] * g["EPL"] <= 32 and n_rep % g["G"] == 0
            for dtype in (mx.bfloat16, mx.float32):
                mma = cpa.takes_mma(dtype, dtype, d)
                assert mma == body_is_mma(str(dtype).rsplit(".", 1)[-1], d)  # (what the split rule sees)
                groups = n_rep // launch_geometry(d, n_rep, mma)["G"]
                assert query_groups(8 * n_rep, 8, d, mma) == groups  # the CUDA heuristic's block count


def test_combine_partials_matches_single_split():
    o = mx.random.normal((2, 3, 4, 8))
    m = mx.array(np.array([[[-np.inf, 0.5, 1.0, -np.inf]] * 3] * 2, np.float32))
    l = mx.ones((2, 3, 4))
    out = combine_partials(o, m, l)
    w = mx.exp(mx.array([0.0, 0.5 - 1.0, 0.0, 0.0]))
    w = mx.where(mx.array([False, True, True, False]), w, 0.0)
    expect = (w[:, None] * o).sum(axis=-2) / w.sum()
    assert max_err(out, expect) <= 1e-6


@needs_cuda
@pytest.mark.parametrize("dtype", [mx.float16, mx.float32], ids=["fp16", "fp32"])
def test_combine_kernel_matches_combine_partials(dtype):
    rng = np.random.default_rng(1)
    o = mx.array(rng.standard_normal((3, 4, 5, 64)).astype(np.float32))
    m = rng.standard_normal((3, 4, 5)).astype(np.float32)
    m[0, :, :] = -np.inf  # an empty row
    m[1, :, 2] = -np.inf  # an empty split
    m, l = mx.array(m), mx.array(rng.uniform(0.5, 2, (3, 4, 5)).astype(np.float32))
    (out,) = cpa._combine_kernel()(
        inputs=[o, m, l],
        template=[("OUT", dtype), ("D", 64)],
        grid=(768, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(3, 4, 64)],
        output_dtypes=[dtype],
    )
    with mx.stream(mx.cpu):
        ref = combine_partials(o, m, l).astype(dtype)
    assert max_err(out, ref) <= TOL[dtype] and mx.all(out[0] == 0).item()


def spying_backend(monkeypatch, seen: list, ops_attention: bool = False):
    """This process's backend made a spy: the CUDA backend, recording each decode attention call's keyword arguments;
    with `ops_attention`, its paged attention is the portable backend's MLX ops (everything else the same)."""
    from mlxcel_core import backends
    from mlxcel_core.backends.base import Backend
    from mlxcel_core.backends.cuda.backend import CudaBackend

    class OpsAttention(CudaBackend):
        kv_written_in_kernel = Backend.kv_written_in_kernel
        paged_runner = Backend.paged_runner
        combine_counters = Backend.combine_counters

    class Spying(OpsAttention if ops_attention else CudaBackend):
        def paged_attention(self, runner):
            real = super().paged_attention(runner)

            def spy(*args, **kwargs):
                seen.append(kwargs)
                return real(*args, **kwargs)

            return spy

    monkeypatch.setattr(backends, "_current", Spying())


@needs_cuda
def test_engine_uses_the_kernel(monkeypatch, tmp_path):
    """A paged engine on CUDA runs decode attention on the kernel, with the chosen num_splits."""
    from mlxcel_core.engine import Engine, EngineConfig
    from mlxcel_core.loading import load_model
    from mlxcel_core.sampling import SamplingParams

    calls = []
    spying_backend(monkeypatch, calls)
    monkeypatch.setenv("MLXCEL_PAGED_DECODE_SPLITS", "4")
    lm = load_model(str(save_tiny_llama(tmp_path / "m")), log=lambda m: None)
    engine = Engine(lm.model, lm.tokenizer, EngineConfig(max_batch_size=2, storage="paged"))
    ids = [engine.open([5, 6, 7, 8], SamplingParams(max_tokens=4)) for _ in range(2)]
    while engine.has_work():
        engine.step()
    assert calls and {c["num_splits"] for c in calls} == {4} and all("new_kv" in c for c in calls)
    assert all(engine.sequence(i).finish_reason is not None for i in ids)


def staggered_greedy_run(model_dir, compile_decode: bool):
    """Three greedy requests on a paged engine, the third opened while the first two decode (its prefill chunks
    update the pools in the same steps as their decodes); each one's tokens."""
    from mlxcel_core.engine import Engine, EngineConfig
    from mlxcel_core.loading import load_model
    from mlxcel_core.sampling import SamplingParams

    lm = load_model(str(model_dir), log=lambda m: None)
    config = EngineConfig(max_batch_size=3, storage="paged", prefill_chunk_size=8, compile_decode=compile_decode)
    engine = Engine(lm.model, lm.tokenizer, config)
    greedy = SamplingParams(max_tokens=40, suppress_tokens=tuple(lm.tokenizer.eos_token_ids))  # 40 tokens each
    ids = [engine.open(list(range(3 + i, 40 + 7 * i)), greedy) for i in range(2)]
    for _ in range(6):
        engine.step()
    ids.append(engine.open(list(range(11, 60)), greedy))  # 49 prompt tokens: 7 chunks beside the decodes
    while engine.has_work():
        engine.step()
    return [engine.sequence(i).output_ids for i in ids]


@needs_cuda
@pytest.mark.parametrize("compile_decode", [False, True])
def test_the_kernel_path_gives_the_portable_paths_tokens(monkeypatch, tmp_path, compile_decode):
    """Four splits a step, the step's keys and values written by the kernel in place and the splits combined by its
    last block (the CUDA backend), against the portable backend's MLX ops attention (scatter, split, merge) in the
    same prepared model: the same greedy tokens for every request, with a prefill interleaved with the decodes, op by
    op and compiled."""
    model_dir = save_tiny_llama(tmp_path / "m")
    monkeypatch.setenv("MLXCEL_PAGED_DECODE_SPLITS", "4")
    ops_calls, kernel_calls = [], []
    spying_backend(monkeypatch, ops_calls, ops_attention=True)
    portable = staggered_greedy_run(model_dir, compile_decode)
    spying_backend(monkeypatch, kernel_calls)
    kernel = staggered_greedy_run(model_dir, compile_decode)
    assert ops_calls and not any("new_kv" in c for c in ops_calls)
    assert kernel_calls and all(c.get("new_kv") is not None and c.get("counters") is not None for c in kernel_calls)
    assert all(len(t) == 40 for t in kernel)
    assert kernel == portable


def test_scale_is_a_compile_time_constant_of_its_float32_bits():
    import struct

    for scale in (128**-0.5, 0.3, 1.0, 1e-6):
        bits = cpa._scale_bits(scale)
        assert 0 < bits < 2**31  # a positive int32 template argument
        assert struct.unpack("<f", struct.pack("<i", bits))[0] == pytest.approx(scale, rel=1e-7)
    for bad in (0.0, -0.1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="positive, finite scale"):
            cpa._scale_bits(bad)
