"""kernels/cubin_cache.py: our CUDA kernels' compiled variants kept on disk, so a second process compiles nothing.

On CPU: the translation unit it writes, compile-once-per-machine with a stand-in compiler, the fallback to MLX's
own kernel, and (where nvcc is installed) every kernel family's real variants -- reached through the same launch
functions the models call -- compiled for sm_90 with the symbol MLX will look up. On CUDA: the cached kernel gives
MLX's kernel's results bit for bit, and a fresh kernel object loads the cubin instead of compiling.
"""

from __future__ import annotations

import subprocess

import mlx.core as mx
import pytest
from cuda_compile import needs_nvcc, nvcc

from mlxcel_core.backends.cuda.kernels import cubin_cache
from mlxcel_core.backends.cuda.kernels.cubin_cache import ELF_MAGIC as ELF
from mlxcel_core.backends.cuda.kernels.cubin_cache import CachedKernel, kernel_text, shape_reads, shape_scalars

BODY = """
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < x_shape[0] * x_shape[1]) { y[i] = static_cast<T>(static_cast<float>(x[i]) * SCALE + (FLAG ? 1 : 0)); }
"""


def test_the_translation_unit_declares_what_the_body_reads():
    text = kernel_text(
        "k_1",
        BODY,
        "// header\n",
        ["x", "w"],
        [mx.bfloat16, mx.uint32],
        [2, 1],
        ["y"],
        [mx.bfloat16],
        [("T", mx.bfloat16), ("SCALE", 3), ("FLAG", True)],
    )
    assert 'extern "C" __global__ void k_1(' in text and "// header" in text
    # inputs, then outputs, then the shape of each input the body reads (w's is not read), as MLX orders scalars
    assert text.index("const __nv_bfloat16* x") < text.index("const uint32_t* w") < text.index("__nv_bfloat16* y")
    assert text.index("__nv_bfloat16* y") < text.index("int x_shape_0") < text.index("int x_shape_1")
    assert "w_shape" not in text
    assert "const int x_shape[2] = {x_shape_0, x_shape_1};" in text
    assert "using T = __nv_bfloat16;" in text and "constexpr int SCALE = 3;" in text
    assert "constexpr bool FLAG = true;" in text
    reads = shape_reads(BODY, ["x", "w"])
    assert reads == [(True, False), (False, False)]
    assert shape_scalars(reads, [mx.zeros((3, 5)), mx.zeros((7,), mx.uint32)]) == [3, 5]


@pytest.fixture
def machine(monkeypatch):
    """A stand-in GPU and NVRTC for the cache's bookkeeping."""
    monkeypatch.setattr(cubin_cache, "gpu_architecture", lambda: "sm_90")
    monkeypatch.setattr(cubin_cache, "nvrtc_version", lambda: "13.0")


def test_a_variant_is_compiled_once_per_machine(tmp_path, machine):
    compiled = []

    def compile_stub(text, name, arch):
        compiled.append(name)
        assert f"void {name}(" in text and arch == "sm_90"
        return ELF + name.encode()

    def kernel():  # each call: a new process's kernel object, same cache directory
        return CachedKernel("mlxcel_t", ["x", "w"], ["y"], BODY, directory=tmp_path, compile=compile_stub)

    args = ([("T", mx.bfloat16), ("SCALE", 3), ("FLAG", True)], [mx.bfloat16, mx.uint32], [2, 1], [mx.bfloat16])
    counted = cubin_cache.COMPILES.variants
    first = kernel()
    name, cubin = first.variant(*args)
    assert first.variant(*args) == (name, cubin) and compiled == [name]
    assert (tmp_path / f"{name}.cubin").read_bytes() == cubin == ELF + name.encode()
    assert kernel().variant(*args) == (name, cubin) and compiled == [name]  # the next process reads the file
    other, _ = kernel().variant([("T", mx.bfloat16), ("SCALE", 4), ("FLAG", True)], *args[1:])
    assert other != name and compiled == [name, other]  # another template value: another variant
    rank, _ = kernel().variant(args[0], args[1], [3, 1], args[3])  # x's rank changes its parameters
    assert rank not in (name, other) and len(compiled) == 3
    assert not list(tmp_path.glob("*.tmp*"))
    assert cubin_cache.COMPILES.variants - counted == len(compiled) == 3  # (what the warm-up's log reports)
    (tmp_path / f"{name}.cubin").write_bytes(b"garbage")  # a damaged file is compiled again and replaced
    assert kernel().variant(*args) == (name, cubin) and compiled[-1] == name and len(compiled) == 4
    assert (tmp_path / f"{name}.cubin").read_bytes() == cubin


def test_a_pdl_variant_is_its_own_cubin_with_the_prologue(tmp_path, machine):
    texts = {}

    def compile_stub(text, name, arch):
        texts[name] = text
        return ELF + name.encode()

    kernel = CachedKernel("mlxcel_t", ["x"], ["y"], BODY, directory=tmp_path, compile=compile_stub)
    args = ([("T", mx.float32), ("SCALE", 1), ("FLAG", False)], [mx.float32], [2], [mx.float32])
    plain, _ = kernel.variant(*args)
    chained, _ = kernel.variant(*args, pdl=True)
    assert plain != chained and len(texts) == 2
    assert "griddepcontrol.wait" not in texts[plain]
    text = texts[chained]
    assert text.index("griddepcontrol.wait") < text.index("griddepcontrol.launch_dependents") < text.index(BODY.strip())


def test_a_body_that_places_its_wait_gets_the_prologue_there():
    """A body with cubin_cache.PDL_WAIT: the prologue goes at the marker, not at the top, and PDL_EARLY says
    whether it is there (the work before it is for a chained launch only); without PDL the marker is dropped."""
    body = "    int a = 1;\n#if PDL_EARLY\n    a = 2;\n#endif\n" + cubin_cache.PDL_WAIT + "\n    y[0] = a;\n"
    args = ("k", body, "", ["x"], [mx.float32], [1], ["y"], [mx.float32], [])
    chained = kernel_text(*args, pdl=True)
    assert chained.count("griddepcontrol.wait") == 1 and cubin_cache.PDL_WAIT not in chained
    assert chained.index("#define PDL_EARLY 1") < chained.index("a = 2;") < chained.index("griddepcontrol.wait")
    assert chained.index("griddepcontrol.launch_dependents") < chained.index("y[0] = a;")
    plain = kernel_text(*args, pdl=False)
    assert "griddepcontrol" not in plain and cubin_cache.PDL_WAIT not in plain and "#define PDL_EARLY 0" in plain
    assert "PDL_EARLY" not in kernel_text("k", BODY, "", ["x"], [mx.float32], [2], ["y"], [mx.float32], [], True)


@pytest.mark.parametrize("contiguous", [True, False])
def test_ensure_row_contiguous_reaches_the_launch_and_mlxs_fallback(tmp_path, machine, monkeypatch, contiguous):
    launched, made = [], []
    monkeypatch.setattr(
        mx.fast, "precompiled_cuda_kernel", lambda **call: launched.append(call) or ["out"], raising=False
    )
    kernel = CachedKernel(
        "mlxcel_t",
        ["x"],
        ["y"],
        BODY,
        directory=tmp_path,
        compile=lambda text, name, arch: ELF,
        ensure_row_contiguous=contiguous,
    )
    call = dict(
        inputs=[mx.zeros((2, 2))],
        template=[("T", mx.float32), ("SCALE", 1), ("FLAG", False)],
        grid=(4, 1, 1),
        threadgroup=(4, 1, 1),
        output_shapes=[(2, 2)],
        output_dtypes=[mx.float32],
    )
    assert kernel(**call) == ["out"] and launched[0]["ensure_row_contiguous"] is contiguous
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **spec: made.append(spec) or (lambda **_: ["mlx"]))
    assert kernel._fallback()(**call) == ["mlx"] and made[0]["ensure_row_contiguous"] is contiguous


def test_an_unwritable_cache_still_runs_the_kernel(tmp_path, machine):
    kernel = CachedKernel(
        "mlxcel_t", ["x"], ["y"], BODY, directory=tmp_path / "missing", compile=lambda text, name, arch: ELF
    )
    assert kernel.variant([("T", mx.float32), ("SCALE", 1), ("FLAG", False)], [mx.float32], [2], [mx.float32])[1] == ELF


def test_a_failed_compile_falls_back_to_mlxs_kernel(tmp_path, machine, monkeypatch, caplog):
    monkeypatch.setattr(cubin_cache, "_warned", False)
    made, calls = [], []

    def mlx_kernel(**spec):
        made.append(spec)
        return lambda **call: calls.append(call) or ["mlx"]

    def broken(text, name, arch):
        raise RuntimeError("no NVRTC here")

    monkeypatch.setattr(mx.fast, "cuda_kernel", mlx_kernel)
    kernel = CachedKernel("mlxcel_t", ["x"], ["y"], BODY, "// h", directory=tmp_path, compile=broken)
    call = dict(
        inputs=[mx.zeros((2, 2))],
        template=[("T", mx.float32), ("SCALE", 1), ("FLAG", False)],
        grid=(4, 1, 1),
        threadgroup=(4, 1, 1),
        output_shapes=[(2, 2)],
        output_dtypes=[mx.float32],
    )
    assert kernel(**call) == ["mlx"] and kernel(**call) == ["mlx"]
    assert made == [
        dict(
            name="mlxcel_t",
            input_names=["x"],
            output_names=["y"],
            source=BODY,
            header="// h",
            ensure_row_contiguous=True,
        )
    ]
    assert len(calls) == 2 and calls[0]["template"] == call["template"] and calls[0]["init_value"] is None
    assert caplog.text.count("not kept in the kernel cache (RuntimeError: no NVRTC here)") == 1  # said once


def test_a_failed_precompiled_launch_falls_back_to_mlxs_kernel(tmp_path, machine, monkeypatch):
    """(An MLX whose precompiled_cuda_kernel takes other arguments, say.)"""

    def refuse(**_):
        raise TypeError("unexpected keyword argument")

    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **spec: lambda **call: ["mlx"])
    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", refuse, raising=False)
    kernel = CachedKernel("mlxcel_t", ["x"], ["y"], BODY, directory=tmp_path, compile=lambda text, name, arch: ELF)
    assert kernel(
        inputs=[mx.zeros((2, 2))],
        template=[("T", mx.float32), ("SCALE", 1), ("FLAG", False)],
        grid=(4, 1, 1),
        threadgroup=(4, 1, 1),
        output_shapes=[(2, 2)],
        output_dtypes=[mx.float32],
    ) == ["mlx"]


def test_without_a_cache_directory_it_is_mlxs_kernel(monkeypatch, tmp_path):
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **spec: ("mlx", spec["name"]))
    monkeypatch.setattr("mlxcel_core.paths.use_kernel_cache", lambda: None)
    assert cubin_cache.cuda_kernel("mlxcel_t", ["x"], ["y"], BODY) == ("mlx", "mlxcel_t")
    monkeypatch.setattr("mlxcel_core.paths.use_kernel_cache", lambda: tmp_path)
    assert isinstance(cubin_cache.cuda_kernel("mlxcel_t", ["x"], ["y"], BODY), CachedKernel)
    monkeypatch.setattr("mlxcel_core.paths.use_kernel_cache", lambda: tmp_path / "made" / "here")
    assert cubin_cache.cuda_kernel("mlxcel_t", ["x"], ["y"], BODY).directory.is_dir()  # (MLX makes its own later)


# -- every kernel family's real variants, compiled by nvcc (where installed) ------------------------------------


def _kernel_factories():
    from mlxcel_core.backends.cuda import paged_attention as cpa
    from mlxcel_core.backends.cuda.kernels import cuda_driver, greedy, hmv, qembedding, qmm, qmv

    return [
        qmv._kernel,
        hmv._kernel,
        greedy._kernel,
        qembedding._kernel,
        qembedding._half_kernel,
        qmm._kernel,
        cpa._kernel,
        cpa._combine_kernel,
        cuda_driver._address_kernel,
    ]


@pytest.fixture
def through_nvcc(tmp_path, machine, monkeypatch):
    """Kernel factories that build CachedKernels compiling with nvcc, and a stand-in launch: each variant a model
    would launch is compiled for sm_90, and its cubin must hold the symbol MLX looks up."""
    built = []

    def compile_nvcc(text, name, arch):
        src = tmp_path / f"{name}.cu"
        src.write_text(text)
        run = subprocess.run(
            [nvcc(), "-std=c++17", f"-arch={arch}", "-cubin", "-o", str(tmp_path / "k.cubin"), str(src)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr[-4000:]
        cubin = (tmp_path / "k.cubin").read_bytes()
        assert name.encode() in cubin  # extern "C": the symbol is the plain name
        built.append(name)
        return cubin

    def launch(*, name, compiled_source, inputs, output_shapes, output_dtypes, scalars, **_):
        assert compiled_source and all(isinstance(s, int) for s in scalars)
        return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes)]

    monkeypatch.setattr(cubin_cache, "compile_cubin", compile_nvcc)
    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", launch, raising=False)
    monkeypatch.setattr("mlxcel_core.paths.use_kernel_cache", lambda: tmp_path)
    for factory in _kernel_factories():
        factory.cache_clear()
    yield built
    for factory in _kernel_factories():
        factory.cache_clear()


@needs_nvcc
def test_every_kernel_familys_variants_compile_with_their_symbol(through_nvcc):
    from mlxcel_core.backends.cuda.kernels import greedy, hmv, qembedding, qmm, qmv, rms_norm
    from mlxcel_core.backends.cuda.paged_attention import cuda_paged_decode_attention

    x = mx.zeros((1, 256), mx.bfloat16)
    w, scales, biases = mx.quantize(mx.zeros((64, 256), mx.bfloat16), group_size=64, bits=4)
    qmv.cuda_quantized_matvec(x, w, scales, biases, 64)
    args = hmv.launch_args(x.shape, x.dtype, mx.bfloat16, 64)
    hmv.launch(args, x, mx.zeros((64, 256), mx.bfloat16))
    greedy._kernel()(
        inputs=[mx.zeros((2, 100), mx.bfloat16)],
        template=[("T", mx.bfloat16), ("TPB", 1024)],
        grid=(2048, 1, 1),
        threadgroup=(1024, 1, 1),
        output_shapes=[(2,), (2,)],
        output_dtypes=[mx.uint32, mx.int32],
    )
    qembedding.quantized_embedding(mx.array([1, 2], mx.uint32), w, scales, biases, 64)
    for dtype in qembedding.HALF_TYPES:
        qembedding.embedding(mx.array([1, 2], mx.uint32), mx.zeros((64, 256), dtype))
    qmm.quantized_matmul(mx.zeros((16, 256), mx.bfloat16), w, scales, biases, 64)
    q = mx.zeros((1, 4, 64), mx.bfloat16)
    pool = mx.zeros((4, 16, 2, 64), mx.bfloat16)
    table, lens = mx.array([[0, 1]], mx.int32), mx.array([20], mx.int32)
    cuda_paged_decode_attention(q, pool, pool, table, lens, num_splits=1)
    cuda_paged_decode_attention(q, pool, pool, table, lens, num_splits=2, _two_launches=True)
    sinks, counters = mx.zeros((4,), mx.bfloat16), mx.zeros((16,), mx.int32)  # (gpt-oss's; windows and chunks)
    cuda_paged_decode_attention(q, pool, pool, table, lens, num_splits=1, sinks=sinks, window=8)
    cuda_paged_decode_attention(q, pool, pool, table, lens, num_splits=2, _two_launches=True, sinks=sinks, chunk=16)
    cuda_paged_decode_attention(q, pool, pool, table, lens, num_splits=2, counters=counters, sinks=sinks)
    cuda_paged_decode_attention(q, pool, pool, table, lens, num_splits=1, mma=False)  # (the lane groups' body)
    cuda_paged_decode_attention(q, pool, pool, table, lens, num_splits=2, _two_launches=True, mma=False)
    rms_norm._kernels.clear()  # (kernels made before the fixture's stand-ins)
    for dtype in (mx.bfloat16, mx.float16, mx.float32):
        rms_norm.rms_norm(mx.zeros((1, 1, 256), dtype), mx.ones((256,), dtype), 1e-5)
    rms_norm._kernels.clear()
    from mlxcel_core.backends.cuda.kernels.cuda_driver import addresses

    for contiguous in (False, True):  # the graph's address reads: a variant a dtype, whatever the count
        addresses([mx.zeros((2,), mx.uint32), mx.zeros((3, 2), mx.bfloat16), mx.zeros((1,), mx.uint32)], contiguous)
    assert sum(n.startswith("mlxcel_addresses_") for n in through_nvcc) == 4
    names = {n.rsplit("_", 1)[0] for n in through_nvcc}
    assert {
        qmv.kernel_name("plain"),
        hmv._kernel().name,
        "mlxcel_greedy_tokens",
        "mlxcel_qembedding",
        "mlxcel_embedding",
        qmm.KERNEL_NAME,
        "paged_decode_one_split",
        "paged_decode_split",
        "paged_decode_combine",
        "paged_decode_one_split_mma",
        "paged_decode_split_mma",
        "paged_decode_one_split_sinks_mma",
        "paged_decode_combine_sinks",
        "paged_decode_split_combine_sinks_mma",
    } <= names, names
    assert sum(n.startswith("mlxcel_rms_norm_") for n in through_nvcc) == 3  # one variant a dtype


@pytest.mark.parametrize(
    "architecture, expected",
    [
        ("sm_90", True),
        ("sm_90a", True),
        ("sm_100", True),
        ("sm_89", False),
        ("sm_80", False),
        ("x86_64", False),
    ],
)
def test_pdl_is_on_from_sm90(monkeypatch, architecture, expected):
    monkeypatch.setattr(cubin_cache.mx, "device_info", lambda: {"architecture": architecture})
    assert cubin_cache.pdl_enabled() is expected
    assert CachedKernel("k", ["x"], ["y"], "y[0] = x[0];", directory=None).pdl is expected


@needs_nvcc
def test_kernels_with_the_pdl_prologue_compile_for_sm90(through_nvcc, monkeypatch, tmp_path):
    """With PDL on (an sm_90 GPU's default): griddepcontrol compiles for sm_90, in a kernel family whose body returns
    early."""
    from mlxcel_core.backends.cuda.kernels import greedy, qembedding

    monkeypatch.setattr(cubin_cache.mx, "device_info", lambda: {"architecture": "sm_90"})
    greedy._kernel()(
        inputs=[mx.zeros((2, 100), mx.bfloat16)],
        template=[("T", mx.bfloat16), ("TPB", 1024)],
        grid=(2048, 1, 1),
        threadgroup=(1024, 1, 1),
        output_shapes=[(2,), (2,)],
        output_dtypes=[mx.uint32, mx.int32],
    )
    qembedding.embedding(mx.array([1, 2], mx.uint32), mx.zeros((64, 256), mx.bfloat16))
    assert len(through_nvcc) == 2
    assert all("griddepcontrol.wait" in (tmp_path / f"{name}.cu").read_text() for name in through_nvcc)


@needs_nvcc
@pytest.mark.parametrize("architecture", ["sm_90", "sm_80"])
def test_the_matvec_kernels_prefetch_experiment_compiles_and_waits_after_it(
    through_nvcc, monkeypatch, tmp_path, architecture
):
    """MLXCEL_PDL_PREFETCH=1 (an experiment; 1 MiB a launch): the 4-bit and 16-bit matvec kernels ask L2 for their
    rows' first share, and the paged attention kernel for its split's first keys and values, before the PDL wait,
    where PDL is on (sm_90: the prefetches compile there), and not at all where it is off; their names differ from the
    default kernels' and by the budget (kernel caches and tuned results are by name)."""
    from mlxcel_core.backends.cuda import paged_attention as cpa
    from mlxcel_core.backends.cuda.kernels import hmv, qmv, qmv_source

    monkeypatch.setattr(cubin_cache.mx, "device_info", lambda: {"architecture": architecture})
    monkeypatch.setenv("MLXCEL_PDL_PREFETCH", "1")
    for factory in (qmv._kernel, hmv._kernel, cpa._kernel):
        factory.cache_clear()
    x = mx.zeros((1, 256), mx.bfloat16)
    w, scales, biases = mx.quantize(mx.zeros((64, 256), mx.bfloat16), group_size=64, bits=4)
    qmv.cuda_quantized_matvec(x, w, scales, biases, 64)
    hmv.launch(hmv.launch_args(x.shape, x.dtype, mx.bfloat16, 64), x, mx.zeros((64, 256), mx.bfloat16))
    names = {n.rsplit("_", 1)[0]: n for n in through_nvcc}
    for weights, first_load in (("q4", "mlxcel_qmv_load_w("), ("half", "mlxcel_hmv_load_w(")):
        name = qmv_source.kernel_name("plain", weights, early=1 << 20)
        assert name != qmv_source.kernel_name("plain", weights) and name in names, names
        assert name != qmv_source.kernel_name("plain", weights, early=2 << 20)  # (the budget is in the text)
        text = (tmp_path / f"{names[name]}.cu").read_text()
        loop = text.index("float acc[ROWS][M];")
        if architecture == "sm_90":
            assert text.index("mlxcel_prefetch_l2(w_row[r]") < text.index("griddepcontrol.wait") < loop
            assert "#define PDL_EARLY 1" in text
        else:
            assert "griddepcontrol" not in text and "#define PDL_EARLY 0" in text
        assert loop < text.index(first_load, loop)
    q, pool = mx.zeros((1, 4, 64), mx.bfloat16), mx.zeros((4, 16, 2, 64), mx.bfloat16)
    new_kv = (mx.zeros((1, 2, 64), mx.bfloat16), mx.zeros((1, 2, 64), mx.bfloat16), mx.array([1]), mx.array([3]))
    table, lens, counters = mx.array([[0, 1]], mx.int32), mx.array([20], mx.int32), mx.zeros((16,), mx.int32)
    cpa.cuda_paged_decode_attention(q, pool, pool, table, lens, num_splits=2, new_kv=new_kv, counters=counters)
    (paged,) = [n for n in through_nvcc if n.startswith("paged_decode_split_combine_new_kv_mma_early_")]
    text = (tmp_path / f"{paged}.cu").read_text()
    if architecture == "sm_90":
        assert text.index("mlxcel_prefetch_l2_sectors(k_pool") < text.index("griddepcontrol.wait")
        assert text.index("griddepcontrol.wait") < text.index("constexpr bool NEW_KV = true;")
    else:
        assert "griddepcontrol" not in text and "#define PDL_EARLY 0" in text
    for factory in (qmv._kernel, hmv._kernel, cpa._kernel):
        factory.cache_clear()


# -- on CUDA ------------------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not (getattr(mx, "cuda", None) and mx.cuda.is_available()), reason="needs CUDA")


@cuda
def test_the_cached_kernel_is_mlxs_kernel_bit_for_bit_and_the_next_process_compiles_nothing(tmp_path, monkeypatch):
    x = mx.random.normal((3, 257)).astype(mx.bfloat16)
    call = dict(
        inputs=[x, mx.zeros((5,), mx.uint32)],
        template=[("T", mx.bfloat16), ("SCALE", 3), ("FLAG", True)],
        grid=(x.size, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[x.shape],
        output_dtypes=[x.dtype],
    )
    (want,) = mx.fast.cuda_kernel(name="mlxcel_cubin_test", input_names=["x", "w"], output_names=["y"], source=BODY)(
        **call
    )
    compiled = []

    def counting(text, name, arch):
        compiled.append(name)
        return cubin_cache.compile_cubin(text, name, arch)

    first = CachedKernel("mlxcel_cubin_test", ["x", "w"], ["y"], BODY, directory=tmp_path, compile=counting)
    (got,) = first(**call)
    assert mx.array_equal(got, want).item() and len(compiled) == 1
    fresh = CachedKernel("mlxcel_cubin_test", ["x", "w"], ["y"], BODY, directory=tmp_path, compile=counting)
    (again,) = fresh(**call)
    assert mx.array_equal(again, want).item() and len(compiled) == 1
    assert len(list(tmp_path.glob("mlxcel_cubin_test_*.cubin"))) == 1


def test_record_launches_keeps_each_launch_as_mlx_makes_it(tmp_path, machine, monkeypatch):
    """What benchmarks/graph_replay.py replays: function, cubin, arrays, shape scalars and grid of each launch, and a
    launch that went to MLX's own kernel marked as not replayable."""
    made = []

    def precompiled(**call):
        made.append(call)
        return [mx.zeros(call["output_shapes"][0])]

    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", precompiled, raising=False)
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **spec: lambda **call: ["mlx"])
    kernel = CachedKernel("mlxcel_t", ["x"], ["y"], BODY, directory=tmp_path, compile=lambda text, name, arch: ELF)
    x = mx.zeros((3, 5))
    call = dict(
        inputs=[x],
        template=[("T", mx.float32), ("SCALE", 1), ("FLAG", False)],
        grid=(15, 1, 1),
        threadgroup=(8, 1, 1),
        output_shapes=[(3, 5)],
        output_dtypes=[mx.float32],
    )
    kernel(**call)  # not recorded
    with cubin_cache.record_launches() as launches:
        (y,) = kernel(**call)
        kernel(**call, init_value=0.0)
        kernel._mlx = lambda **_: ["mlx"]  # from now on MLX's kernel (as after a failed compile)
        assert kernel(**call) == ["mlx"]
    kernel(**call)
    assert len(made) == 3 and len(launches) == 3
    first = launches[0]
    assert first.func == made[1]["name"] and first.func.startswith("mlxcel_t_") and first.cubin == ELF
    assert first.inputs[0] is x and first.outputs[0] is y and first.scalars == [3, 5] == made[1]["scalars"]
    assert first.grid == (15, 1, 1) and first.threadgroup == (8, 1, 1)
    assert launches[1].func is None  # init_value: MLX fills the outputs first, a launch the recording lacks
    assert launches[2].func is None and launches[2].inputs[0] is x


def test_nvrtc_is_found_by_its_own_file_name_not_its_builtins(tmp_path):
    # a process that imported torch maps libnvrtc-builtins (no nvrtcVersion) before MLX's libnvrtc
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 1 /venv/nvidia/cu13/lib/libnvrtc-builtins.so.13.0\n"
        "7f02-7f03 r-xp 00000000 08:01 2 /venv/nvidia/cu13/lib/libnvrtc.so.13\n"
    )
    assert cubin_cache._loaded_library("libnvrtc", str(maps)) == "/venv/nvidia/cu13/lib/libnvrtc.so.13"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 1 /venv/lib/libnvrtc-builtins.so.13.0\n")
    assert cubin_cache._loaded_library("libnvrtc", str(maps)) is None
