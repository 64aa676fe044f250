"""kernels/compile_ahead.py: a dry run's launches give zeros while the variants they need compile side by side.

On CPU with a stand-in compiler and launch: the compiles overlap (a barrier only the parallel form passes), the dry
run launches nothing, the real run then compiles nothing and launches the cubins, a failed compile is left to the
real run, and a dry run says so through the backend seam (autotuning measures nothing inside it)."""

from __future__ import annotations

import threading

import mlx.core as mx
import pytest

from mlxcel_core.backends.cuda.kernels import compile_ahead, cubin_cache
from mlxcel_core.backends.cuda.kernels.cubin_cache import ELF_MAGIC as ELF
from mlxcel_core.backends.cuda.kernels.cubin_cache import CachedKernel

BODY = """
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < x_shape[0] * x_shape[1]) { y[i] = static_cast<T>(static_cast<float>(x[i]) * SCALE); }
"""


@pytest.fixture
def machine(monkeypatch):
    """A stand-in GPU, NVRTC and launch; the launches made."""
    monkeypatch.setattr(cubin_cache, "gpu_architecture", lambda: "sm_90")
    monkeypatch.setattr(cubin_cache, "nvrtc_version", lambda: "13.0")
    launched = []

    def launch(*, name, compiled_source, output_shapes, output_dtypes, **_):
        launched.append((name, compiled_source))
        return [mx.ones(s, dtype=d) for s, d in zip(output_shapes, output_dtypes)]

    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", launch, raising=False)
    return launched


def _call(kernel, scale: int, dtype=mx.float16):
    return kernel(
        inputs=[mx.ones((2, 3), dtype)],
        template=[("T", dtype), ("SCALE", scale)],
        grid=(6, 1, 1),
        threadgroup=(6, 1, 1),
        output_shapes=[(2, 3)],
        output_dtypes=[dtype],
    )


def test_a_dry_run_gives_zeros_and_compiles_what_it_launched_side_by_side(tmp_path, machine):
    together = threading.Barrier(3, timeout=20)  # passed only by three compiles running at once
    compiled = []

    def compile_stub(text, name, arch):
        together.wait()
        compiled.append((name, threading.current_thread().name))
        return ELF + name.encode()

    kernel = CachedKernel("mlxcel_t", ["x"], ["y"], BODY, directory=tmp_path, compile=compile_stub)
    counted = cubin_cache.COMPILES.variants
    with compile_ahead.collecting(workers=3) as ahead:
        assert compile_ahead.active()
        outs = [_call(kernel, s) for s in (1, 2, 3, 2)]  # (the repeated variant is compiled once)
        for (y,) in outs:
            assert y.shape == (2, 3) and y.dtype == mx.float16 and not mx.any(y).item()
        assert machine == []  # the dry run launches nothing
    assert not compile_ahead.active()
    assert len(ahead.submitted) == 3 and sorted(n for n, _ in compiled) == sorted(ahead.submitted)
    assert all(thread.startswith("mlxcel-nvrtc") for _, thread in compiled)
    assert cubin_cache.COMPILES.variants - counted == 3
    assert sorted(p.stem for p in tmp_path.glob("*.cubin")) == sorted(ahead.submitted)
    assert not list(tmp_path.glob("*.tmp*"))
    # the real run: every variant read from the cache, launched with its cubin, nothing compiled again
    (y,) = _call(kernel, 2)
    assert mx.all(y).item() and len(compiled) == 3
    name, cubin = machine[-1]
    assert name in ahead.submitted and cubin == ELF + name.encode()


def test_a_cached_variant_is_not_compiled_again_and_a_failed_one_is_left_to_the_real_run(tmp_path, machine):
    calls = []

    def compile_stub(text, name, arch):
        calls.append(name)
        if calls.count(name) == 1 and "SCALE = 5;" in text:
            raise RuntimeError("out of memory")
        return ELF + name.encode()

    kernel = CachedKernel("mlxcel_t", ["x"], ["y"], BODY, directory=tmp_path, compile=compile_stub)
    _call(kernel, 1)  # compiled and kept before the dry run
    counted = cubin_cache.COMPILES.variants
    with compile_ahead.collecting(workers=2) as ahead:
        _call(kernel, 1)
        _call(kernel, 5)
    assert len(ahead.submitted) == 1 and len(calls) == 2  # only the missing one, which failed
    assert cubin_cache.COMPILES.variants == counted  # (a failed compile is not counted)
    (y,) = _call(kernel, 5)  # the real run compiles it as a launch always has
    assert mx.all(y).item() and calls.count(calls[-1]) == 2 and len(calls) == 3


def test_one_dry_run_at_a_time_and_an_error_inside_still_waits_for_the_compiles(tmp_path, machine):
    done = threading.Event()

    def slow(text, name, arch):
        done.wait(5)
        return ELF + name.encode()

    kernel = CachedKernel("mlxcel_t", ["x"], ["y"], BODY, directory=tmp_path, compile=slow)
    with pytest.raises(ValueError, match="the dry run broke"):
        with compile_ahead.collecting(workers=1) as ahead:
            with pytest.raises(RuntimeError, match="collecting already"):
                with compile_ahead.collecting():
                    pass
            _call(kernel, 7)
            done.set()
            raise ValueError("the dry run broke")
    assert not compile_ahead.active() and len(ahead.submitted) == 1
    assert (tmp_path / f"{ahead.submitted[0]}.cubin").exists()  # the compile ended before the error came out


def test_the_cuda_backend_runs_its_dry_runs_through_the_seam_where_it_keeps_kernels(monkeypatch, tmp_path):
    from mlxcel_core.backends.base import Backend
    from mlxcel_core.backends.cuda.backend import CudaBackend

    backend = CudaBackend()
    assert Backend().compile_ahead() is None and not Backend().in_dry_run()
    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", lambda **_: [], raising=False)
    monkeypatch.setattr("mlxcel_core.paths.use_kernel_cache", lambda: None)
    assert backend.compile_ahead() is None  # no kernel cache: the kernels are MLX's own
    monkeypatch.setattr("mlxcel_core.paths.use_kernel_cache", lambda: tmp_path)
    assert not backend.in_dry_run()
    with backend.compile_ahead():
        assert backend.in_dry_run()
    assert not backend.in_dry_run()


def test_the_dry_run_ends_with_the_address_kernels_variants_the_recording_reads(monkeypatch, tmp_path):
    """A graph recording (the warm-up proper's) reads its arrays' addresses with a kernel variant per dtype and copy
    mode: the dry run launches each, for the steps' dtypes and the model's, after the rest and with the final norm
    as the recording runs it, so none compiles later on the serving thread."""
    from mlxcel_core.backends.cuda import backend as cuda_backend
    from mlxcel_core.backends.cuda.kernels import cuda_driver, rms_norm
    from mlxcel_core.loading.shapes import build_random_model

    model, _ = build_random_model("tiny", bits=4, dtype="float16")
    launched, norm_as_kernel = [], []
    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", lambda **_: [], raising=False)
    monkeypatch.setattr("mlxcel_core.paths.use_kernel_cache", lambda: tmp_path)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        cuda_driver,
        "addresses",
        lambda arrays, ensure_row_contiguous=False: launched.append(
            (arrays[0].dtype, ensure_row_contiguous, compile_ahead.active())
        ),
    )
    with cuda_backend.CudaBackend().compile_ahead(model):
        norm_as_kernel.append(rms_norm._as_kernel.get())
        assert launched == []
    want = [mx.bfloat16, mx.float16, mx.float32, mx.int32, mx.uint32]  # (the model's: uint32 words, float16 scales)
    assert launched == [(d, c, True) for d in want for c in (False, True)] and norm_as_kernel == [True]
    launched.clear()
    with cuda_backend.CudaBackend().compile_ahead():
        pass
    assert [d for d, c, _ in launched if not c] == want
